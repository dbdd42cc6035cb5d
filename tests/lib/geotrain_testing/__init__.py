"""geotrain_testing: what geotrain's tests and benchmarks share. Not part of the user-facing client
(clients/python, the `geotrain` package), which never imports it.

  clusters     real geotrain processes on loopback: ClusterUp (`geotrain cluster up`, processes killed and restarted),
               LocalCluster (a head and workers started one by one), private_env and private_cluster_env (an
               environment that talks only to one's own cluster), run, wait_for, free_port, pss_bytes
  shards       token shards in llm.c's .bin layout (write_token_shard) and the small corpora tests train on
  checkpoints  safetensors files and checkpoint step directories, read into numpy (needs numpy)
  logs         the step lines of a cluster job and of `geotrain train --local`, parsed
  timed        the timed-compute studies' harness: plans run on timed clusters, the planner calibrated and asked

Found through PYTHONPATH: ctest runs every Python test with PYTHONPATH=<source>/tests/lib (tests/lib/pythonpath.cmake),
and so do `make study` (bench/geo/run_all.sh) and tests/gpu/run.sh; by hand, from the checkout,
`export PYTHONPATH=$PWD/tests/lib` (docs/benchmarks.md). Import the modules by name:
`from geotrain_testing.clusters import ClusterUp`.
"""
