# pdserve: the gateway, the CPU engine and the default model in one image.
# The build steps are the README's: a Rust toolchain, pip for the model download,
# `cargo build --release -p pdserve`, `pdserve model fetch`.
#
#   docker build -t pdserve:latest .
#   docker run --rm -p 8000:8000 pdserve:latest up --host 0.0.0.0
#
# The binary is portable: no `-C target-cpu=native`; the engine's kernels choose AVX2/FMA/F16C
# at run time and fall back to scalar code elsewhere, so the image runs on any x86-64.

FROM rust:1-slim-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends python3-pip && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release -p pdserve
ENV PDSERVE_HOME=/opt/pdserve
RUN target/release/pdserve model fetch

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/pdserve /usr/local/bin/pdserve
COPY --from=build /opt/pdserve /opt/pdserve
ENV PDSERVE_HOME=/opt/pdserve
# Gateway 8000, worker HTTP 8100, worker KV transfer 8200.
EXPOSE 8000 8100 8200
ENTRYPOINT ["pdserve"]
CMD ["up", "--host", "0.0.0.0"]
