# The engine image: vLLM's own OpenAI-compatible server image, with kvpool's connector
# installed from this source tree at build time (nothing is installed when a pod starts).
#   docker build -f deploy/engine.Dockerfile -t REGISTRY/kvpool-vllm:0.2.0 .   (make images)
# VLLM_VERSION: a release of the `vllm` extra's range (0.32, 0.33: pyproject.toml); the
# compatibility check reads this one's wheel (tests/integrations/test_vllm_compat.py).
ARG VLLM_VERSION=v0.33.0
FROM vllm/vllm-openai:${VLLM_VERSION}
COPY pyproject.toml README.md LICENSE /opt/kvpool/
COPY src /opt/kvpool/src
# kvpool and its own dependencies; vLLM (and its torch) stay as the image has them.
RUN python3 -m pip install --no-cache-dir /opt/kvpool && rm -rf /opt/kvpool
ENTRYPOINT ["vllm", "serve"]
