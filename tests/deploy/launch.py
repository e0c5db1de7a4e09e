"""Start one container's process (tests/deploy/kubelet.py): run as root in a mount
namespace of its own, it opens to other users the directories this machine keeps from them
on the way to the interpreter and the checkout (``/root``), then becomes the container's
user and group with its capabilities, and executes the container's command.

    python launch.py SPEC.json
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path


def open_to_others(paths: list[str]) -> None:
    """Bind a world-traversable directory over each ancestor others cannot traverse,
    holding (bind-mounted back) the children these paths go through."""
    children: dict[Path, set[str]] = {}
    for path in paths:
        real = Path(os.path.realpath(path))
        for ancestor in [*reversed(real.parents), real]:
            if ancestor == real:
                break
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                child = real.relative_to(ancestor).parts[0]
                children.setdefault(ancestor, set()).add(child)
                break
    for ancestor, names in children.items():
        stand_in = Path(tempfile.mkdtemp(prefix="kvpool-open-"))
        stand_in.chmod(0o755)
        for name in names:
            source = ancestor / name
            target = stand_in / name
            if source.is_dir():
                target.mkdir()
            else:
                target.touch()
            subprocess.run(["mount", "--bind", str(source), str(target)], check=True)
        subprocess.run(["mount", "--rbind", str(stand_in), str(ancestor)], check=True)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    open_to_others(spec["open"])
    if spec.get("hosts"):  # the cluster's DNS names of Services, as the pod resolves them
        hosts = Path(tempfile.mkdtemp(prefix="kvpool-hosts-")) / "hosts"
        lines = [f"{ip} {name}" for name, ip in spec["hosts"].items()]
        hosts.write_text(Path("/etc/hosts").read_text() + "\n".join(lines) + "\n")
        hosts.chmod(0o644)
        subprocess.run(["mount", "--bind", str(hosts), "/etc/hosts"], check=True)
    setpriv = ["setpriv", "--reuid", str(spec["uid"]), "--regid", str(spec["gid"])]
    groups = [str(g) for g in spec["groups"]]
    setpriv += ["--groups", ",".join(groups)] if groups else ["--clear-groups"]
    if spec["no_new_privs"]:
        setpriv.append("--no-new-privs")
    if spec["drop_all"]:
        kept = "".join(f",+{cap}" for cap in spec["add"])
        setpriv += ["--bounding-set", f"-all{kept}", "--inh-caps", f"-all{kept}"]
    argv = [*setpriv, "--", *spec["argv"]]
    os.execvpe(argv[0], argv, spec["env"])


if __name__ == "__main__":
    main()
