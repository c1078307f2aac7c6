"""A local node: a real kubelet, its own containerd with runc, CNI and a device plugin, as a
node of a user's cluster runs them. All but the CNI plugins (Debian's) are built from pinned
Go modules by ``ladle cluster build``.

Several nodes share one machine, which a kubelet does not expect, so each gets what it would
have on a machine of its own:

- its own containerd: a kubelet treats every pod its runtime holds as its own, and kills those
  it was not given;
- its own view of the file system, a mount namespace in which ``/var/lib`` and ``/var/log`` are
  folders of the node's: the kubelet keeps state at fixed paths there (its device plugin socket
  and checkpoint under ``/var/lib/kubelet/device-plugins``, log links in
  ``/var/log/containers``, CNI's cache in ``/var/lib/cni``), and its mounts (volumes, pod
  networks, container file systems) stay in that namespace and end with it;
- its own cgroup root and address; the network namespace is the cluster's
  (``ladle_dev.cluster.network``), shared by all its nodes.

Ladle's images are imported into each node's containerd (no registry is reachable), as a node
image would have them pre-pulled; see ``ladle_dev.cluster.images``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import yaml

from ladle_dev.cluster import cgroups, images
from ladle_dev.cluster.network import Plan

RUN_ROOT = Path("/run/ladle")
# The host folders a node sees folders of its own in place of.
VIEW_PATHS = ("/var/lib", "/var/log")
CNI_BIN_DIR = Path("/usr/lib/cni")
CAP_SYS_RESOURCE = 24
KUBELET_PORT = 10250
KUBELET_HEALTHZ_PORT = 10248
# The namespace the kubelet's CRI calls use; imported images must land there.
CRI_NAMESPACE = "k8s.io"
# Plugins a node never uses: the opt plugin installs into /opt/containerd, NRI listens on a
# fixed socket (shared by every node here), and the other snapshotters need devices or tools.
DISABLED_PLUGINS = (
    "io.containerd.internal.v1.opt",
    "io.containerd.nri.v1.nri",
    "io.containerd.snapshotter.v1.blockfile",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.erofs",
    "io.containerd.snapshotter.v1.zfs",
    "io.containerd.differ.v1.erofs",
    "io.containerd.image-verifier.v1.bindir",
)


class NodeError(RuntimeError):
    """A node's component failed; the message names which and why."""


@dataclass(frozen=True)
class NodeSpec:
    """What one local node is: its name, address, pod range, labels and taints."""

    index: int
    name: str
    ip: str
    pod_cidr: str
    labels: dict[str, str] = field(default_factory=dict)
    # kubelet's --register-with-taints form: key=value:Effect
    taints: tuple[str, ...] = ()


class LocalNode:
    """Paths, configuration and commands of one node; the cluster starts and stops them."""

    def __init__(self, cluster_dir: Path, cluster_id: str, net: Plan, spec: NodeSpec) -> None:
        self.spec = spec
        self.net = net
        self.cluster_id = cluster_id
        self.dir = cluster_dir / "nodes" / spec.name
        # Sockets live under /run, whose short paths keep within a socket path's 108 bytes.
        self.run_dir = RUN_ROOT / cluster_id / str(spec.index)

    # -- paths -------------------------------------------------------------------------------
    @property
    def socket(self) -> Path:
        return self.run_dir / "containerd.sock"

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    @property
    def cgroup_root(self) -> str:
        return f"/ladle/{self.cluster_id}/{self.spec.name}"

    @property
    def view(self) -> Path:
        """Where the node's own ``/var/lib`` and ``/var/log`` live, seen from the host."""
        return self.dir / "view"

    @property
    def kubelet_dir(self) -> Path:
        """The kubelet's root folder (``/var/lib/kubelet`` on the node), seen from the host."""
        return self.view / "var/lib/kubelet"

    @property
    def mount_namespace(self) -> Path:
        return self.run_dir / "mnt"

    @property
    def content_blobs(self) -> Path:
        """containerd's content store: a blob's file is ``<algorithm>/<hex digest>`` in it."""
        return self.dir / "containerd" / "io.containerd.content.v1.content" / "blobs"

    @property
    def cni_conf_dir(self) -> Path:
        return self.dir / "cni" / "net.d"

    # -- configuration -----------------------------------------------------------------------
    def containerd_config(self, bins: Path) -> str:
        """containerd's TOML (schema version 4, as ``containerd config default`` prints it)."""
        disabled = ", ".join(f"'{name}'" for name in DISABLED_PLUGINS)
        runtime = "plugins.'io.containerd.cri.v1.runtime'"
        return f"""version = 4
root = '{self.dir / "containerd"}'
state = '{self.run_dir / "state"}'
disabled_plugins = [{disabled}]
required_plugins = ['io.containerd.grpc.v1.cri']

[plugins.'io.containerd.server.v1.grpc']
  address = '{self.socket}'

[plugins.'io.containerd.server.v1.ttrpc']
  address = '{self.socket}.ttrpc'

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  # Layers are kept once, unpacked: the runtime image is seven gigabytes.
  discard_unpacked_layers = true

  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{images.PAUSE}'

[{runtime}]
  # Pods' network namespaces under the state folder, not the host's /var/run/netns.
  netns_mounts_under_state_dir = true
  # Without CAP_SYS_RESOURCE (this machine's root lacks it), no process may lower its OOM
  # score, and runc fails to start the kubelet's -998 pause container: clamp scores at ours.
  restrict_oom_score_adj = {str(not _can_lower_oom_score()).lower()}
  cdi_spec_dirs = []

  [{runtime}.containerd.runtimes.runc.options]
    BinaryName = '{bins / "runc"}'

  [{runtime}.cni]
    bin_dirs = ['{CNI_BIN_DIR}']
    conf_dir = '{self.cni_conf_dir}'

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'
"""

    def cni_config(self) -> dict[str, Any]:
        """ptp: a veth per pod and a /32 route to it, so pod traffic is routed (and kube-proxy's
        rules apply) in the cluster's namespace; routes to the cluster's /16 only."""
        return {
            "cniVersion": "1.0.0",
            "name": "ladle",
            "plugins": [
                {
                    "type": "ptp",
                    "ipMasq": False,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(self.dir / "cni" / "ipam"),
                        "ranges": [[{"subnet": self.spec.pod_cidr}]],
                        "routes": [{"dst": self.net.cidr}],
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}, "snat": False},
            ],
        }

    def kubelet_config(self, ca: Path, serving: tuple[Path, Path]) -> dict[str, Any]:
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # This machine's cgroups are v1; since 1.35 the kubelet refuses them unless told.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "address": self.spec.ip,
            "port": KUBELET_PORT,
            "readOnlyPort": 0,
            "healthzBindAddress": self.spec.ip,
            "healthzPort": KUBELET_HEALTHZ_PORT,
            "tlsCertFile": str(serving[0]),
            "tlsPrivateKeyFile": str(serving[1]),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(ca)},
            },
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": self.endpoint,
            # The machine's disk is shared with the developer; evict on real exhaustion only.
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1Gi",
                "imagefs.available": "1Gi",
            },
            # Images are imported, not pulled: collecting one would leave it unrunnable.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "failSwapOn": False,
            "resolvConf": "",
            "clusterDomain": "cluster.local",
            "shutdownGracePeriod": "0s",
            # A mounted ConfigMap (a service's LoRA modules file) is refreshed at its pod's
            # sync: every 10 s here, where tests wait on it, instead of the default minute.
            "syncFrequency": "10s",
        }

    def write_config(self, bins: Path, ca: Path, serving: tuple[Path, Path]) -> None:
        for folder in (self.dir, self.run_dir, self.cni_conf_dir):
            folder.mkdir(parents=True, exist_ok=True)
        (self.dir / "containerd.toml").write_text(self.containerd_config(bins))
        (self.cni_conf_dir / "10-ladle.conflist").write_text(
            json.dumps(self.cni_config(), indent=2)
        )
        config = self.kubelet_config(ca, serving)
        (self.dir / "kubelet.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        cgroups.create(self.cgroup_root)

    def create_view(self) -> None:
        """The node's mount namespace, kept by a bind mount of it at ``mount_namespace``: a
        slave of the host's (the host's mounts show in it, its own never leave it), with the
        node's folders over ``VIEW_PATHS``."""
        binds = []
        for path in VIEW_PATHS:
            own = self.view / path.lstrip("/")
            own.mkdir(parents=True, exist_ok=True)
            binds.append(f"mount --bind {own} {path}")
        self.mount_namespace.touch()
        subprocess.run(
            ["unshare", f"--mount={self.mount_namespace}", "--propagation", "slave",
             "sh", "-c", " && ".join(binds)],
            check=True, capture_output=True,
        )  # fmt: skip

    # -- commands ----------------------------------------------------------------------------
    def enter(self, argv: list[str]) -> list[str]:
        """``argv`` run on the node: in the cluster's network namespace and the node's view."""
        return self.net.enter([f"--mount={self.mount_namespace}"], argv)

    def containerd_argv(self, bins: Path) -> list[str]:
        return self.enter([str(bins / "containerd"), "--config", str(self.dir / "containerd.toml")])

    def kubelet_argv(self, bins: Path, kubeconfig: Path) -> list[str]:
        labels = ",".join(f"{key}={value}" for key, value in self.spec.labels.items())
        argv = [
            str(bins / "kubelet"),
            f"--config={self.dir / 'kubelet.yaml'}",
            f"--kubeconfig={kubeconfig}",
            f"--hostname-override={self.spec.name}",
            f"--node-ip={self.spec.ip}",
            f"--cert-dir={self.dir / 'kubelet-pki'}",
            f"--node-labels={labels}",
        ]
        if self.spec.taints:
            argv.append(f"--register-with-taints={','.join(self.spec.taints)}")
        return self.enter(argv)

    def gpu_plugin_argv(self, bins: Path, gpus: int) -> list[str]:
        """The fake NVIDIA device plugin: the kubelet counts and allocates the node's GPUs."""
        return self.enter([str(bins / "gpu-plugin"), f"--count={gpus}", f"--node={self.spec.name}"])

    def env(self, bins: Path) -> dict[str, str]:
        """containerd finds its shim on PATH (CNI's plugins are Debian's, in their own folder)."""
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join(
            [str(bins), "/usr/local/sbin", "/usr/sbin", "/sbin", env.get("PATH", "")]
        )
        return env

    def ctr(
        self, bins: Path, *args: str, stdin: BinaryIO | None = None, data: bytes | None = None
    ) -> tuple[int, str]:
        """Run ``ctr`` against the node's containerd, in the CRI's namespace, reading ``stdin``
        or ``data``: its exit code and output."""
        proc = subprocess.run(
            [str(bins / "ctr"), "--address", str(self.socket), "--namespace", CRI_NAMESPACE, *args],
            stdin=stdin, input=data, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            timeout=600, check=False,
        )  # fmt: skip
        return proc.returncode, proc.stdout.decode(errors="replace").strip()

    def wait_containerd(self, bins: Path, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            code, output = self.ctr(bins, "version")
            if code == 0:
                return
            if time.monotonic() > deadline:
                raise NodeError(f"{self.spec.name}: containerd did not answer: {output}")
            time.sleep(0.2)

    def container_pid(self, bins: Path, container_id: str) -> int:
        """The host's pid of a container's first process (``containerID`` without its
        ``containerd://``), as the CRI reports it."""
        inspected = subprocess.run(
            [str(bins / "crictl"), "--runtime-endpoint", self.endpoint, "inspect", container_id],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return int(json.loads(inspected.stdout)["info"]["pid"])

    def held_images(self, bins: Path) -> dict[str, str]:
        """Tag → image id of what the node's containerd holds (through the CRI)."""
        listed = subprocess.run(
            [str(bins / "crictl"), "--runtime-endpoint", self.endpoint, "images", "-o", "json"],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return {
            tag: str(image["id"]).removeprefix("sha256:")
            for image in json.loads(listed.stdout)["images"]
            for tag in image.get("repoTags") or ()
        }

    def import_images(self, bins: Path, references: list[str]) -> None:
        """Import each image from the layout without copying its layers.

        containerd's default ("shared") content policy lets a write that names the digest of
        a blob its store holds register that blob without data. So the layers are hard-linked
        into the node's content store, the image is imported without them and not unpacked
        (its manifest names them, which keeps them from the garbage collector once they are
        registered), each layer is registered by its digest, and a second import unpacks the
        image, reading the layers in place. A node thus costs the disk only its unpacked
        snapshots; its content store shares the layout's files. (Across file systems the
        layers are copied instead, and a node holds them twice.)"""
        with images.locked(shared=True):
            for reference in references:
                self._import_linked(bins, reference)

    def _import_linked(self, bins: Path, reference: str) -> None:
        blobs = images.image_blobs(reference)
        archive = _oci_archive(blobs)
        self._ctr_ok(
            bins, f"importing {reference}", "images", "import", "--local", "--no-unpack", "-",
            data=archive,
        )  # fmt: skip
        self._collect_garbage(bins)
        for digest, path in blobs.layers:
            algorithm, _, hexdigest = digest.partition(":")
            target = self.content_blobs / algorithm / hexdigest
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except FileExistsError:
                pass
            except OSError as err:
                if err.errno != errno.EXDEV:
                    raise
            # Should a collection (another deletion triggers one) sweep the link before the
            # layer is registered, this copies the layer from stdin: slower, not wrong.
            with path.open("rb") as layer:
                self._ctr_ok(
                    bins, f"registering layer {digest} of {reference}", "content", "ingest",
                    f"--expected-digest={digest}", f"--expected-size={path.stat().st_size}",
                    f"ladle-{hexdigest}", stdin=layer,
                )  # fmt: skip
        self._ctr_ok(
            bins, f"unpacking {reference}", "images", "import", "--local", "-", data=archive
        )

    def _collect_garbage(self, bins: Path) -> None:
        """Wait for a full collection. The end of an import (its lease deleted) triggers one
        that sweeps every file of the content store no namespace has registered, as the
        links about to be made are until then; deleting a lease synchronously waits for a
        collection, which starts after the one in flight."""
        lease = f"ladle-gc-{os.getpid()}-{time.monotonic_ns()}"
        self._ctr_ok(bins, "creating a lease", "leases", "create", "--id", lease)
        self._ctr_ok(bins, "collecting garbage", "leases", "delete", "--sync", lease)

    def layer_dirs(self, bins: Path, reference: str) -> list[Path]:
        """The folders holding the image's unpacked layers in the node's overlay snapshotter,
        bottom first: the lower folders of a read-only view of its top layer."""
        key = f"ladle-layers-{os.getpid()}-{time.monotonic_ns()}"
        code, output = self.ctr(
            bins, "snapshots", "view", "--mounts", key, images.chain_ids(reference)[-1]
        )
        if code != 0:
            raise NodeError(f"{self.spec.name}: viewing {reference}'s layers failed: {output}")
        try:
            mounts = json.loads(output[output.index("[") :])
        finally:
            self.ctr(bins, "snapshots", "rm", key)
        (mount,) = mounts  # Go's field names: containerd's mount.Mount has no JSON tags
        if mount["Type"] == "bind":  # a one-layer image
            return [Path(mount["Source"])]
        (lower,) = (o for o in mount["Options"] if o.startswith("lowerdir="))
        return [Path(p) for p in reversed(lower.removeprefix("lowerdir=").split(":"))]

    def _ctr_ok(
        self,
        bins: Path,
        what: str,
        *args: str,
        stdin: BinaryIO | None = None,
        data: bytes | None = None,
    ) -> None:
        code, output = self.ctr(bins, *args, stdin=stdin, data=data)
        if code != 0:
            raise NodeError(f"{self.spec.name}: {what} failed: {output}")

    # -- teardown ----------------------------------------------------------------------------
    def remove_pods(self, bins: Path, timeout: float = 60.0) -> None:
        """Stop and remove every pod through the CRI, as the kubelet would: containers end,
        pod networks are torn down by CNI and their mounts are released."""
        if not self.socket.exists():
            return
        subprocess.run(
            [str(bins / "crictl"), "--runtime-endpoint", self.endpoint, "--timeout", "30s",
             "rmp", "--all", "--force"],
            capture_output=True, timeout=timeout, check=False,
        )  # fmt: skip

    def clean(self) -> None:
        """What must not outlive the node, whatever state its processes ended in: its cgroups
        (and any process left in them), its view (unmounting its namespace's last reference
        ends every mount in it), and its runtime folder."""
        cgroups.remove(self.cgroup_root)
        unmount_under((self.dir, self.run_dir))
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.run_dir)


def share_layers(nodes: list[LocalNode], bins: Path, references: tuple[str, ...]) -> int:
    """Hard-link the files of the images' unpacked layers on every node to the first node's:
    returns how many files it linked.

    Each node unpacks its own copy of every layer (a node's containerd owns its snapshots),
    so without this two nodes hold two copies of the runtime image on disk, and the page
    cache holds torch's libraries once per node whose pods load them: 7.3 GB of disk and
    hundreds of megabytes of memory per node. A layer's files are never written in place
    (overlayfs copies a file up before any change), so one inode can serve every node."""
    linked = 0
    first, *others = nodes
    if not others:
        return linked
    for reference in references:
        source = first.layer_dirs(bins, reference)
        for node in others:
            for ours, theirs in zip(source, node.layer_dirs(bins, reference), strict=True):
                linked += _link_same_files(ours, theirs)
    return linked


def _link_same_files(source: Path, target: Path) -> int:
    """Replace each regular file under ``target`` by a hard link to the file at the same
    path under ``source`` where both are the same file of the same layer (size, mode, owner
    and modification time agree)."""
    linked = 0
    # Beside the layer's folder (``snapshots/<id>/fs``), never inside it: a link left there by
    # a crash would show in every container.
    spare = target.parent / "ladle-link"
    for folder, _, files in os.walk(target):
        mirror = source / Path(folder).relative_to(target)
        for name in files:
            ours, theirs = mirror / name, Path(folder) / name
            try:
                a, b = ours.lstat(), theirs.lstat()
            except FileNotFoundError:
                continue
            same = (a.st_size, a.st_mode, a.st_uid, a.st_gid, a.st_mtime_ns) == (
                b.st_size, b.st_mode, b.st_uid, b.st_gid, b.st_mtime_ns,
            )  # fmt: skip
            if not same or not stat.S_ISREG(a.st_mode) or a.st_ino == b.st_ino:
                continue
            os.link(ours, spare)
            os.replace(spare, theirs)
            linked += 1
    return linked


def private_run_root(cluster_id: str) -> Path:
    """``/run/ladle/<cluster>``, made a private mount of itself: a mount namespace can be kept
    by a bind mount only on a mount that does not propagate."""
    path = RUN_ROOT / cluster_id
    path.mkdir(parents=True, exist_ok=True)
    if str(path) not in mount_points_under((path,)):
        subprocess.run(["mount", "--bind", path, path], check=True, capture_output=True)
        subprocess.run(["mount", "--make-private", path], check=True, capture_output=True)
    return path


def release_run_root(cluster_id: str) -> None:
    """Undo ``private_run_root``, with whatever is still mounted below it."""
    path = RUN_ROOT / cluster_id
    unmount_under((path,))
    with contextlib.suppress(OSError):
        shutil.rmtree(path)


def _can_lower_oom_score() -> bool:
    """Whether this process holds CAP_SYS_RESOURCE, which lowering an OOM score takes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    return False


def _oci_archive(blobs: images.Blobs) -> bytes:
    """An OCI image layout, as a tar, of one image's index, manifest and config: its layers
    are registered in the node's content store apart."""
    stream = io.BytesIO()
    with tarfile.open(fileobj=stream, mode="w") as tar:
        _add_bytes(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        index = {"schemaVersion": 2, "manifests": [blobs.descriptor]}
        _add_bytes(tar, "index.json", json.dumps(index).encode())
        for digest, path in blobs.metadata:
            algorithm, _, hexdigest = digest.partition(":")
            tar.add(path, arcname=f"blobs/{algorithm}/{hexdigest}")
    return stream.getvalue()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def mount_points_under(roots: tuple[Path, ...]) -> list[str]:
    """Mount points at or below any of ``roots``, deepest first (from /proc/self/mountinfo,
    whose octal escapes are undone)."""
    prefixes = [str(root.resolve()) for root in roots]
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if any(point == prefix or point.startswith(prefix + "/") for prefix in prefixes):
            found.append(point)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


def unmount_under(roots: tuple[Path, ...]) -> None:
    """Unmount everything below ``roots``: a lazy unmount where a busy one is refused."""
    for point in mount_points_under(roots):
        if subprocess.run(["umount", point], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
