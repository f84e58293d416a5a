# p2p-diloco in a container; the entry point is the `p2p-diloco` command.
#   docker build -t p2p-diloco .                                          # CPU
#   docker build -t p2p-diloco:cuda --build-arg BASE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126 .   # CUDA
#   docker run --rm -p 31337:31337 -p 31338:31338 -v p2p-diloco:/data p2p-diloco bootstrap \
#       --identity /data/bootstrap.key --host-maddrs /ip4/0.0.0.0/tcp/31337 --relay-port 31338 --peers-file /data/peers.txt
#   docker run --rm --gpus all -v p2p-diloco:/data p2p-diloco:cuda peer --config llama-150m --initial-peers ... \
#       --identity /data/island.key --checkpoint-dir /data/ckpt
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# iproute2 for `ss` (the transport byte counters); python3-venv where the base is not a Python image.
RUN apt-get update && apt-get install -y --no-install-recommends iproute2 python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/p2p-diloco
ENV PATH=/opt/p2p-diloco/bin:$PATH
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX}
COPY pyproject.toml README.md /src/
COPY p2p_diloco /src/p2p_diloco
COPY peers /src/peers
COPY bootstrap /src/bootstrap
RUN pip install --no-cache-dir /src && rm -rf /src
WORKDIR /data
STOPSIGNAL SIGTERM
ENTRYPOINT ["p2p-diloco"]
CMD ["--help"]
