"""Pod specs run as the kubelet would run them, here: each container's command and arguments
(or its image's entrypoint and command), its environment (values, the pod's fields, Secret
keys, ``$(VAR)`` references), its user, group and capabilities (the container's
securityContext, else the pod's, else the image's ``USER``), and its volumes: a hostPath
the kubelet creates as root:root 0755 when its type is ``DirectoryOrCreate`` (and refuses
when ``Directory`` names one missing), a Secret or ConfigMap as read-only files.

What differs from a kubelet, and why:
- Volume paths are mapped, not mounted: a container path in an environment value, an
  argument or a mounted ConfigMap's file (a config file naming the container's paths) is
  replaced by the host directory behind it (``root`` stands for the server's filesystem),
  so that the process runs among this machine's files.
- The image's binaries are this machine's: ``kvpool`` (this checkout's), ``install``,
  ``etcd`` (Debian's).  An engine container's ``vllm serve`` cannot run here (no GPU, no
  CUDA image): :func:`probe` runs in its place, with the container's environment, user and
  volumes, and its connector configuration (the ``--kv-transfer-config`` argument).
- Each pod runs in a host of the test fabric (its own network namespace), so that the ports
  a spec names are its own.
- Sizes a server has and this machine has not (a 64 GiB arena) are scaled down (``sizes``:
  the variables, and the values they take here), and what this machine cannot reach is
  said (``offline``: ``HF_HUB_OFFLINE``, where a model hub would be fetched from); nothing
  else of the environment changes.
- Each process runs in a mount namespace of its own where directories this machine keeps
  from other users (``/root``, where the interpreter lives) are opened to them: what an
  image's filesystem gives its user, this machine's does not.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.cluster.fabric import Host

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # kvpool and python of this checkout's environment
LAUNCHER = Path(__file__).with_name("launch.py")


@dataclass(frozen=True)
class Image:
    """What a container runs when its spec does not say: the Dockerfile's ``USER``,
    ``ENTRYPOINT`` and ``CMD``."""

    uid: int
    gid: int
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...] = ()

    @classmethod
    def of_dockerfile(cls, path: Path) -> Image:
        text = path.read_text()
        user = re.findall(r"^USER (\d+)(?::(\d+))?$", text, re.M)
        uid, gid = (int(user[-1][0]), int(user[-1][1] or user[-1][0])) if user else (0, 0)
        entry = re.findall(r"^ENTRYPOINT (\[.*\])$", text, re.M)
        cmd = re.findall(r"^CMD (\[.*\])$", text, re.M)
        return cls(
            uid,
            gid,
            tuple(json.loads(entry[-1])) if entry else (),
            tuple(json.loads(cmd[-1])) if cmd else (),
        )


IMAGES = {
    "kvpool/kvpool": Image.of_dockerfile(ROOT / "deploy" / "Dockerfile"),
    "kvpool/kvpool-vllm": Image.of_dockerfile(ROOT / "deploy" / "engine.Dockerfile"),
    "quay.io/coreos/etcd": Image(0, 0, ()),
}
# The image's programs, as this machine has them.
PROGRAMS = {"kvpool": str(BIN / "kvpool"), "python3": sys.executable}


def image_of(container: dict) -> Image:
    repository = container["image"].rpartition(":")[0]
    return IMAGES[repository]


@dataclass
class Pod:
    """One pod on one server of the fabric: ``root`` is that server's filesystem (hostPaths
    live under it), ``secrets`` and ``config_maps`` the cluster's objects."""

    spec: dict
    host: Host
    root: Path
    name: str = "pod-0"
    namespace: str = "kvpool"
    secrets: Mapping[str, Mapping[str, bytes]] = field(default_factory=dict)
    config_maps: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    hosts: Mapping[str, str] = field(default_factory=dict)  # Services' DNS names -> IP
    claims: tuple[str, ...] = ()  # volumes of a StatefulSet's claims: empty directories
    offline: Mapping[str, str] = field(default_factory=dict)  # added: no network here
    sizes: Mapping[str, str] = field(
        default_factory=lambda: {"KVPOOL_MEMORY": "64MiB", "KVPOOL_DISK_SIZE": "256MiB"}
    )
    _files: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvpool-pod-")))

    def volume_dirs(self) -> dict[str, Path]:
        """Each volume's directory on the server, prepared as the kubelet prepares it."""
        dirs = {}
        self._files.chmod(0o755)  # the pod's users read their volumes' files
        for claim in self.claims:
            dirs[claim] = self._files / f"claim-{claim}"
            dirs[claim].mkdir(exist_ok=True)
        for volume in self.spec.get("volumes", []):
            name = volume["name"]
            if "hostPath" in volume:
                path = self.root / volume["hostPath"]["path"].lstrip("/")
                kind = volume["hostPath"].get("type", "")
                if not path.exists():
                    if kind != "DirectoryOrCreate":
                        raise RuntimeError(f"hostPath {path} ({kind}) is missing: no pod")
                    path.mkdir(parents=True)
                    os.chown(path, 0, 0)
                    path.chmod(0o755)  # as the kubelet creates it
                dirs[name] = path
            elif "emptyDir" in volume:
                dirs[name] = self._files / f"empty-{name}"
                dirs[name].mkdir(exist_ok=True)
                dirs[name].chmod(0o777)  # as the kubelet makes an emptyDir
            elif "secret" in volume or "configMap" in volume:
                source = volume.get("secret") or volume["configMap"]
                objects = self.secrets if "secret" in volume else self.config_maps
                data = objects[source.get("secretName") or source["name"]]
                items = source.get("items") or [{"key": k, "path": k} for k in data]
                target = self._files / name
                target.mkdir(exist_ok=True)
                target.chmod(0o755)
                for item in items:
                    value = data[item["key"]]
                    file = target / item["path"]
                    file.write_bytes(value if isinstance(value, bytes) else value.encode())
                    file.chmod(0o644)  # the kubelet's defaultMode
                dirs[name] = target
        return dirs

    def environment(self, container: dict) -> dict[str, str]:
        """The container's environment, as the kubelet makes it."""
        fields = {
            "spec.nodeName": self.host.name,
            "status.podIP": self.host.ip,
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
        }
        env: dict[str, str] = {}
        for entry in container.get("env", []):
            if entry["name"] in self.sizes:
                env[entry["name"]] = self.sizes[entry["name"]]
            elif "value" in entry:
                env[entry["name"]] = expand(entry["value"], env)
            elif "fieldRef" in entry["valueFrom"]:
                env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
            else:
                ref = entry["valueFrom"]["secretKeyRef"]
                env[entry["name"]] = self.secrets[ref["name"]][ref["key"]].decode()
        return {**env, **self.offline}

    def command(self, container: dict) -> list[str]:
        image = image_of(container)
        command = container.get("command") or list(image.entrypoint)
        args = container.get("args", [] if container.get("command") else list(image.cmd))
        return [*command, *args]

    def user(self, container: dict) -> tuple[int, int]:
        image = image_of(container)
        pod = self.spec.get("securityContext", {})
        own = container.get("securityContext", {})
        uid = own.get("runAsUser", pod.get("runAsUser", image.uid))
        gid = own.get("runAsGroup", pod.get("runAsGroup", image.gid))
        if own.get("runAsNonRoot", pod.get("runAsNonRoot", False)) and uid == 0:
            raise RuntimeError(f"{container['name']}: runAsNonRoot, and it would run as root")
        return uid, gid

    def start(
        self,
        name: str,
        *,
        init: bool = False,
        argv: list[str] | None = None,
        probe_env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[str]:
        """Start container ``name`` (an init container with ``init``); ``argv``: run this in
        its place (a probe, told ``probe_env`` besides), with its environment, user and
        volumes."""
        kind = "initContainers" if init else "containers"
        container = next(c for c in self.spec[kind] if c["name"] == name)
        dirs = self.volume_dirs()
        mounts = {m["mountPath"]: dirs[m["name"]] for m in container.get("volumeMounts", [])}
        for mount in container.get("volumeMounts", []):
            if self._is_config_map(mount["name"]):
                mounts[mount["mountPath"]] = self._mapped(dirs[mount["name"]], name, mounts)
        env = {k: map_paths(v, mounts) for k, v in self.environment(container).items()}
        command = [map_paths(expand(part, env), mounts) for part in self.command(container)]
        if argv is not None:
            env.update(probe_env or {}, KVPOOL_POD_COMMAND=json.dumps(command))
            command = argv
        command[0] = PROGRAMS.get(command[0]) or shutil.which(command[0]) or command[0]
        uid, gid = self.user(container)
        context = container.get("securityContext", {})
        capabilities = context.get("capabilities", {})
        spec = {
            "argv": command,
            "env": {"PATH": f"{BIN}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/tmp", **env},
            "uid": uid,
            "gid": gid,
            "groups": self.spec.get("securityContext", {}).get("supplementalGroups", []),
            "no_new_privs": context.get("allowPrivilegeEscalation") is False,
            "drop_all": "ALL" in capabilities.get("drop", []),
            "add": [c.lower() for c in capabilities.get("add", [])],
            "open": [sys.executable, str(BIN), str(ROOT)],
            "hosts": dict(self.hosts),
        }
        file = self._files / f"{name}.json"
        file.write_text(json.dumps(spec))
        launch = [*self.host.prefix, "unshare", "--mount", "--propagation", "private", "--"]
        launch += [sys.executable, str(LAUNCHER), str(file)]
        return subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def _is_config_map(self, volume_name: str) -> bool:
        return any(
            "configMap" in v and v["name"] == volume_name for v in self.spec.get("volumes", [])
        )

    def _mapped(self, source: Path, container: str, mounts: Mapping[str, Path]) -> Path:
        """A copy of a ConfigMap volume's files for ``container``, its paths mapped."""
        target = self._files / f"{source.name}-for-{container}"
        target.mkdir(exist_ok=True)
        target.chmod(0o755)
        for file in source.iterdir():
            copy = target / file.name
            copy.write_text(map_paths(file.read_text(), mounts))
            copy.chmod(0o644)
        return target

    def run(self, name: str, *, init: bool = False, timeout: float = 60) -> str:
        """Run a container to its end (an init container): its output; it must succeed."""
        process = self.start(name, init=init)
        output, _ = process.communicate(timeout=timeout)
        if process.returncode != 0:
            raise RuntimeError(f"{name} exited {process.returncode}: {output}")
        return output

    def close(self) -> None:
        with contextlib.suppress(OSError):
            shutil.rmtree(self._files)


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` references: to a variable defined before, else left as they
    are; ``$$`` is a literal ``$``."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def map_paths(text: str, mounts: Mapping[str, Path]) -> str:
    """``text`` with every container path under a mount replaced by the host directory
    behind it (the longest mount first)."""
    for mount_path in sorted(mounts, key=len, reverse=True):
        pattern = re.escape(mount_path.rstrip("/")) + r"(?=/|$|[\s\"',])"
        text = re.sub(pattern, str(mounts[mount_path]).replace("\\", "\\\\"), text)
    return text
