# syntax=docker/dockerfile:1
# Images for slipway-operator, slipway-router and slipway-engine:
#   docker build --target operator -t slipway-operator .
#   docker build --target router   -t slipway-router .
#   docker build --target engine   -t slipway-engine .
#
# The builder is the toolchain rust-toolchain.toml pins (1.95.0), and it builds through
# operator/scripts/build-release-binaries, the script operator/scripts/build-like-dockerfile
# runs where Docker cannot (`make image-binaries`), which also checks that this file
# still names that toolchain and that script.

FROM rust:1.95.0-bookworm AS builder
RUN apt-get update \
 && apt-get install -y --no-install-recommends musl-tools \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# rust-toolchain.toml selects the same 1.95.0; the musl target is for the static operator
# and router.
COPY rust-toolchain.toml ./
RUN rustup target add x86_64-unknown-linux-musl
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    operator/scripts/build-release-binaries /out

# The operator: one static binary, nothing else (it reaches the API server with the
# ServiceAccount's own CA file), as the non-root user the Deployment runs as.
FROM scratch AS operator
COPY --from=builder /out/slipway-operator /slipway-operator
USER 65532:65532
ENTRYPOINT ["/slipway-operator"]

# The router: one static binary, nothing else, like the operator (it reaches the API
# server with its ServiceAccount's CA file and the engines over plain HTTP).
FROM scratch AS router
COPY --from=builder /out/slipway-router /slipway-router
USER 65532:65532
ENTRYPOINT ["/slipway-router"]

# The engine (glibc): the same Debian release as the builder, non-root with the id the
# operator's pods run as (65532). TLS roots for `fetch` are compiled in.
FROM debian:bookworm-slim AS engine
COPY --from=builder /out/slipway-engine /usr/local/bin/slipway-engine
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/slipway-engine"]
