# The Python test package (tests/lib/geotrain_testing: cluster harness, token shards, checkpoints, step lines) is
# found through PYTHONPATH: every ctest that runs Python sets ENVIRONMENT "PYTHONPATH=${GEOTRAIN_TESTING_PYTHONPATH}"
# (prefixed with the client package's directory where it also imports `geotrain`). Included by tests/CMakeLists.txt
# and clients/python/CMakeLists.txt (which CMake reads first).
set(GEOTRAIN_TESTING_PYTHONPATH "${CMAKE_CURRENT_LIST_DIR}")
