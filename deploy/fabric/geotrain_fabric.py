#!/usr/bin/env python3
"""A geotrain cluster on FABRIC (https://fabric-testbed.net), with FABRIC's Python API (fablib).

Creates a slice of N sites x M GPU nodes (one FABNetv4 network per site, routed between sites), installs the
geotrain .deb on every node, writes /etc/geotrain (token file, env files, optionally TLS certificates), opens
the ports, starts the head (first node of the first site) and a worker on every node under systemd, and
starts Prometheus on the head's node with the head's file-based discovery. docs/deploy.md explains each step.

    # build the package on Debian 12 first: make build && (cd build && cpack -G DEB)
    deploy/fabric/geotrain_fabric.py --slice geotrain --sites UTAH,STAR --nodes-per-site 2 \\
        --gpu GPU_RTX6000 --deb build/geotrain_0.1.0_amd64.deb [--tls] [--dry-run]
    deploy/fabric/geotrain_fabric.py --slice geotrain --delete

--dry-run prints every step (each fablib call, each remote command and each file written, in order) and
runs none of them; it needs neither fablib nor FABRIC credentials. The cluster token goes to the nodes as a
file (mode 0600) and is never put on a command line: not here, not on the nodes (the units read
GEOTRAIN_TOKEN_FILE).
fablib (pip install fabrictestbed-extensions) is imported only for a real run, which also needs the usual
fablib configuration (~/work/fabric_config/fabric_rc, or FABRIC_* variables).
"""
import argparse
import ipaddress
import os
import secrets
import shlex
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

HEAD_PORT = 6380
HEAD_METRICS_PORT = 9470
WORKER_PORT = 6381
WORKER_METRICS_PORT = 9471
PROMETHEUS_PORT = 9090
# FABNetv4: every site's network is a subnet of this range, routed through the site's gateway.
FABNET_V4 = ipaddress.ip_network("10.128.0.0/10")
SHARE = "/usr/share/geotrain"


def log(line=""):
    print(line, flush=True)


# ---- dry run: stand-ins for fablib's objects that print each call ----

def _args_text(args, kwargs):
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return ", ".join(parts)


class _DryRunObject:
    """Prints each fablib call made on it as `fablib: <label>.<method>(<arguments>)`, except execute and
    upload_file, which remote() and upload() log in both modes as `[node] $ command` and `[node] upload`."""

    def __init__(self, label):
        self._label = label

    def _call(self, method, *args, result=None, **kwargs):
        shown = f" -> {result}" if result is not None else ""
        log(f"fablib: {self._label}.{method}({_args_text(args, kwargs)}){shown}")


class DryRunInterface(_DryRunObject):
    def ip_addr_add(self, addr, subnet):
        self._call("ip_addr_add", addr=str(addr), subnet=str(subnet))


class DryRunComponent(_DryRunObject):
    def __init__(self, label):
        super().__init__(label)
        self._interface = DryRunInterface(f"{label}.interface[0]")

    def get_interfaces(self):
        self._call("get_interfaces")
        return [self._interface]


class DryRunNode(_DryRunObject):
    def __init__(self, name):
        super().__init__(f"node[{name}]")
        self.name = name
        self._components = {}

    def add_component(self, model, name):
        self._call("add_component", model=model, name=name)
        self._components[name] = DryRunComponent(f"{self._label}.{name}")
        return self._components[name]

    def get_interface(self, network_name):
        self._call("get_interface", network_name=network_name)
        return self._components["nic0"]._interface

    def ip_route_add(self, subnet, gateway):
        self._call("ip_route_add", subnet=str(subnet), gateway=str(gateway))

    def upload_file(self, local_file_path, remote_file_path):
        pass

    def execute(self, command, quiet=False):
        return f"{EXIT_MARK}0\n", ""

    def get_management_ip(self):
        ip = f"<management IP of {self.name}>"
        self._call("get_management_ip", result=ip)
        return ip


class DryRunNetwork(_DryRunObject):
    """A site's FABNetv4 network; the dry run numbers site k's subnet 10.128.k.0/24 (FABRIC assigns real ones)."""

    def __init__(self, name, index):
        super().__init__(f"network[{name}]")
        self._subnet = ipaddress.ip_network(f"10.128.{index + 1}.0/24")

    def get_subnet(self):
        self._call("get_subnet", result=str(self._subnet))
        return self._subnet

    def get_gateway(self):
        gateway = self._subnet.network_address + 1
        self._call("get_gateway", result=str(gateway))
        return gateway

    def get_available_ips(self):
        ips = [self._subnet.network_address + i for i in range(2, 12)]
        self._call("get_available_ips", result=f"[{ips[0]} ... {ips[-1]}]")
        return ips


class DryRunSlice(_DryRunObject):
    def __init__(self, name):
        super().__init__(f"slice[{name}]")
        self._nodes, self._networks = {}, {}

    def add_node(self, name, site, cores, ram, disk, image):
        self._call("add_node", name=name, site=site, cores=cores, ram=ram, disk=disk, image=image)
        self._nodes[name] = DryRunNode(name)
        return self._nodes[name]

    def add_l3network(self, name, interfaces, type):
        self._call("add_l3network", name=name, interfaces=f"<{len(interfaces)} interfaces>", type=type)
        self._networks[name] = DryRunNetwork(name, len(self._networks))
        return self._networks[name]

    def submit(self):
        self._call("submit")

    def get_node(self, name):
        self._call("get_node", name=name)
        return self._nodes[name]

    def get_network(self, name):
        self._call("get_network", name=name)
        return self._networks[name]

    def delete(self):
        self._call("delete")


class DryRunFablib(_DryRunObject):
    def __init__(self):
        super().__init__("fablib")
        log("fablib: FablibManager()")

    def new_slice(self, name):
        self._call("new_slice", name=name)
        return DryRunSlice(name)

    def get_slice(self, name):
        self._call("get_slice", name=name)
        return DryRunSlice(name)


def real_fablib():
    try:
        from fabrictestbed_extensions.fablib.fablib import FablibManager  # noqa: PLC0415 (lazy: not installable here)
    except ImportError:
        sys.exit("geotrain_fabric.py: fablib is not installed; run `pip install fabrictestbed-extensions` "
                 "(and configure it: https://learn.fabric-testbed.net), or pass --dry-run to see the steps")
    return FablibManager()


# ---- what runs on the nodes ----

EXIT_MARK = "geotrain-fabric-exit="


def remote(node, name, command):
    """Runs a shell command on a node and returns its output; stops the deployment, with the command's
    output, when it fails (fablib's execute returns output, not the exit status: a marker line carries it)."""
    log(f"[{name}] $ {command}")
    stdout, stderr = node.execute(f"{command}; echo {EXIT_MARK}$?", quiet=True)
    lines = stdout.rstrip("\n").split("\n")
    if not lines or not lines[-1].startswith(EXIT_MARK) or lines[-1] != f"{EXIT_MARK}0":
        sys.exit(f"geotrain_fabric.py: on {name}, `{command}` failed:\n{stdout}{stderr}")
    return "\n".join(lines[:-1])


def upload(node, name, local_path, remote_path, shown=None):
    """Copies a file to the node (as the login user); `shown` is what the log says about its contents."""
    log(f"[{name}] upload {shown or local_path} -> {remote_path}")
    node.upload_file(local_path, remote_path)


def install_file(node, name, local_path, dest, mode, owner="root", shown=None, show_text=False):
    """Copies a local file to `dest` on the node with the given mode and owner (through a file in the login
    user's home, removed after). With show_text the contents are logged (env files; never the token)."""
    staged = os.path.basename(dest) + ".upload"
    upload(node, name, local_path, staged, shown=shown or os.path.basename(local_path))
    if show_text:
        with open(local_path) as f:
            for line in f.read().splitlines():
                log(f"    {line}")
    remote(node, name, f"sudo install -D -m {mode} -o {owner} -g {owner} {staged} {dest} && rm -f {staged}")


def open_ports_command(source, ports=()):
    """Lets TCP `ports` (none: every port) in from `source` through the node's firewall, if one is active."""
    return " ".join(["sudo", f"{SHARE}/open-ports.sh", source] + [str(p) for p in ports])


def env_text(values):
    return "".join(f"{k}={v}\n" for k, v in values.items())


def write_local(directory, filename, text, mode=0o644):
    path = os.path.join(directory, filename)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return path


def enable_service(node, name, unit):
    remote(node, name, f"sudo install -m 0644 {SHARE}/systemd/{unit}.service /etc/systemd/system/ && "
                       f"sudo systemctl daemon-reload && sudo systemctl enable --now {unit}")
    # Restart=on-failure would hide a unit that keeps failing: wait until it stays up.
    remote(node, name, f"sleep 3 && systemctl is-active --quiet {unit} || "
                       f"(sudo journalctl -u {unit} -n 30 --no-pager; exit 1)")


# ---- the deployment ----

def plan_nodes(sites, nodes_per_site):
    """[(site, node name)] in order; the first node of the first site runs the head."""
    return [(site, f"{site.lower()}-{i}") for site in sites for i in range(nodes_per_site)]


def create_slice(fablib, args, nodes):
    log(f"== creating slice {args.slice}: {len(args.sites)} sites x {args.nodes_per_site} nodes ({args.gpu})")
    slice_ = fablib.new_slice(name=args.slice)
    interfaces = {site: [] for site in args.sites}
    for site, name in nodes:
        node = slice_.add_node(name=name, site=site, cores=args.cores, ram=args.ram, disk=args.disk,
                               image=args.image)
        for g in range(args.gpus_per_node):
            node.add_component(model=args.gpu, name=f"gpu{g}")
        interfaces[site].append(node.add_component(model="NIC_Basic", name="nic0").get_interfaces()[0])
    for site in args.sites:
        slice_.add_l3network(name=f"fabnet-{site.lower()}", interfaces=interfaces[site], type="IPv4")
    slice_.submit()
    return slice_


def configure_network(slice_, args, nodes):
    """Addresses each node on its site's FABNetv4 network and routes the other sites through its gateway."""
    log("== addressing the nodes on FABNetv4")
    addresses, subnets = {}, {}
    for site in args.sites:
        network_name = f"fabnet-{site.lower()}"
        network = slice_.get_network(name=network_name)
        subnet, gateway = network.get_subnet(), network.get_gateway()
        subnets[site] = subnet
        available = iter(network.get_available_ips())
        for node_site, name in nodes:
            if node_site != site:
                continue
            node = slice_.get_node(name=name)
            address = next(available)
            node.get_interface(network_name=network_name).ip_addr_add(addr=address, subnet=subnet)
            node.ip_route_add(subnet=FABNET_V4, gateway=gateway)
            addresses[name] = str(address)
    return addresses, subnets


def deploy(slice_, args, nodes, addresses, subnets, token_path, workdir):
    head_site, head_name = nodes[0]
    head_address = f"{addresses[head_name]}:{HEAD_PORT}"
    tls_dir = None
    if args.tls:
        tls_dir = os.path.join(workdir, "tls")
        command = ["bash", os.path.join(REPO, "deploy", "make-certs.sh"), tls_dir] + [addresses[n] for _, n in nodes]
        log(f"local: {' '.join(shlex.quote(c) for c in command)}")
        if not args.dry_run:
            subprocess.run(command, check=True)
    tls_env = {}
    if tls_dir:
        tls_env = {"GEOTRAIN_TLS_CERT": "/etc/geotrain/tls/server.pem", "GEOTRAIN_TLS_KEY": "/etc/geotrain/tls/server.key",
                   "GEOTRAIN_TLS_CA": "/etc/geotrain/tls/ca.pem"}

    for site, name in nodes:
        node = slice_.get_node(name=name)
        is_head = name == head_name
        log(f"== {name} ({site}, {addresses[name]}){' : head and worker' if is_head else ' : worker'}")
        if args.node_setup:
            upload(node, name, args.node_setup, "geotrain-node-setup.sh")
            remote(node, name, "sudo bash geotrain-node-setup.sh")
        upload(node, name, args.deb, "geotrain.deb")
        remote(node, name, "sudo apt-get update -q && sudo DEBIAN_FRONTEND=noninteractive "
                           "apt-get install -y -q ./geotrain.deb && rm -f geotrain.deb")
        install_file(node, name, token_path, "/etc/geotrain/token", "0600", owner="geotrain",
                     shown="<the cluster token file>")
        if tls_dir:
            for filename, mode in (("ca.pem", "0644"), ("server.pem", "0644"), ("server.key", "0600")):
                install_file(node, name, os.path.join(tls_dir, filename), f"/etc/geotrain/tls/{filename}", mode,
                             owner="geotrain")
        worker_env = {"GEOTRAIN_HEAD": head_address, "GEOTRAIN_SITE": site.lower(),
                      "GEOTRAIN_TOKEN_FILE": "/etc/geotrain/token",
                      "GEOTRAIN_ADVERTISE_ADDRESS": f"{addresses[name]}:{WORKER_PORT}",
                      "GEOTRAIN_WORKER_PORT": WORKER_PORT, "GEOTRAIN_METRICS_PORT": WORKER_METRICS_PORT, **tls_env}
        install_file(node, name, write_local(workdir, f"worker-{name}.env", env_text(worker_env)),
                     "/etc/geotrain/worker.env", "0644", show_text=True)
        ports = [WORKER_PORT, WORKER_METRICS_PORT]
        if is_head:
            head_env = {"GEOTRAIN_TOKEN_FILE": "/etc/geotrain/token", "GEOTRAIN_ADVERTISE_HOST": addresses[name],
                        "GEOTRAIN_HEAD_PORT": HEAD_PORT, "GEOTRAIN_METRICS_PORT": HEAD_METRICS_PORT,
                        "GEOTRAIN_STATE_DIR": "/var/lib/geotrain", **tls_env}
            install_file(node, name, write_local(workdir, "head.env", env_text(head_env)), "/etc/geotrain/head.env",
                         "0644", show_text=True)
            ports = [HEAD_PORT, HEAD_METRICS_PORT, PROMETHEUS_PORT] + ports
        # The cluster's ports to every FABNetv4 address; everything to the node's own site (NCCL picks ports).
        remote(node, name, open_ports_command(str(FABNET_V4), ports))
        remote(node, name, open_ports_command(str(subnets[site])))
        if is_head:
            enable_service(node, name, "geotrain-head")

    log("== starting the workers")
    for site, name in nodes:
        enable_service(slice_.get_node(name=name), name, "geotrain-worker")

    head = slice_.get_node(name=head_name)
    if args.prometheus:
        log(f"== Prometheus on {head_name}: file discovery of the head's targets")
        remote(head, head_name, "sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus && "
                                f"sudo install -m 0644 {SHARE}/prometheus/prometheus.yml "
                                f"{SHARE}/prometheus/geotrain-alerts.yml /etc/prometheus/ && "
                                "sudo systemctl restart prometheus")

    log("== the cluster as the head sees it")
    # The CLI as the service user, which can read the token file; the token itself stays in the file.
    cli = f"sudo -u geotrain env GEOTRAIN_HEAD={head_address} GEOTRAIN_TOKEN_FILE=/etc/geotrain/token geotrain"
    cli_tls = " --tls-ca /etc/geotrain/tls/ca.pem" if tls_dir else ""
    status = remote(head, head_name, f"sleep 5 && {cli} status{cli_tls}")
    if status:
        log(status)
    management_ip = head.get_management_ip()
    log(f"head: {head_address} on {head_name} ({management_ip}); {len(nodes)} workers in {len(args.sites)} sites")
    log(f"submit a job on {head_name}: {cli} job submit job.yaml --follow{cli_tls}")
    log(f"Prometheus: ssh -L {PROMETHEUS_PORT}:localhost:{PROMETHEUS_PORT} (through the FABRIC bastion) to "
        f"{management_ip}, then http://localhost:{PROMETHEUS_PORT}; Grafana: import "
        f"{SHARE}/grafana/geotrain-dashboard.json")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slice", required=True, help="slice name")
    p.add_argument("--sites", type=lambda s: [x.strip().upper() for x in s.split(",") if x.strip()],
                   help="comma-separated FABRIC sites, e.g. UTAH,STAR (the head runs on the first)")
    p.add_argument("--nodes-per-site", type=int, default=1, help="GPU nodes per site (default 1)")
    p.add_argument("--gpu", default="GPU_RTX6000", help="GPU model: GPU_RTX6000, GPU_A30, GPU_A40, GPU_TeslaT4")
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--cores", type=int, default=16)
    p.add_argument("--ram", type=int, default=64, help="GB")
    p.add_argument("--disk", type=int, default=100, help="GB")
    p.add_argument("--image", default="default_debian_12", help="node image; the .deb is built for Debian 12")
    p.add_argument("--deb", help="the geotrain .deb to install (cpack -G DEB in the build dir)")
    p.add_argument("--token-file", help="cluster token file to use (default: a new random token)")
    p.add_argument("--node-setup", help="a local shell script run as root on every node before the .deb "
                                        "(e.g. the NVIDIA driver and the CUDA runtime for a CUDA build)")
    p.add_argument("--tls", action="store_true", help="make certificates for every node (deploy/make-certs.sh)")
    p.add_argument("--no-prometheus", dest="prometheus", action="store_false",
                   help="do not install Prometheus on the head's node")
    p.add_argument("--delete", action="store_true", help="delete the slice and stop")
    p.add_argument("--dry-run", action="store_true", help="print every step, run nothing (no fablib needed)")
    args = p.parse_args(argv)
    if not args.delete:
        if not args.sites:
            p.error("--sites is required (e.g. --sites UTAH,STAR)")
        if args.nodes_per_site < 1:
            p.error("--nodes-per-site must be at least 1")
        if not args.deb or not os.path.isfile(args.deb):
            p.error(f"--deb: no such package {args.deb!r}; build it with `cd build && cpack -G DEB`")
        if args.token_file and not os.path.isfile(args.token_file):
            p.error(f"--token-file: no such file {args.token_file!r}")
        if args.node_setup and not os.path.isfile(args.node_setup):
            p.error(f"--node-setup: no such file {args.node_setup!r}")
    return args


def main(argv):
    args = parse_args(argv)
    fablib = DryRunFablib() if args.dry_run else real_fablib()
    if args.delete:
        fablib.get_slice(name=args.slice).delete()
        return 0
    nodes = plan_nodes(args.sites, args.nodes_per_site)
    with tempfile.TemporaryDirectory(prefix="geotrain-fabric-") as workdir:
        token_path = args.token_file
        if not token_path:
            token_path = write_local(workdir, "token", secrets.token_hex(16) + "\n", mode=0o600)
            log(f"local: new cluster token in {token_path} (mode 0600)")
        slice_ = create_slice(fablib, args, nodes)
        addresses, subnets = configure_network(slice_, args, nodes)
        deploy(slice_, args, nodes, addresses, subnets, token_path, workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
