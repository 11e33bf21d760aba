# kvtrie-server image: Debian 12, the same packages as a developer machine.
#   docker build -t kvtrie .
#   docker run -p 50051:50051 -v kvtrie-data:/var/lib/kvtrie kvtrie
FROM debian:12 AS build
WORKDIR /src
COPY deploy/install_deps.sh deploy/install_deps.sh
RUN deploy/install_deps.sh && rm -rf /var/lib/apt/lists/*
COPY . .
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DKVTRIE_BUILD_TESTS=OFF -DKVTRIE_BUILD_BENCH=OFF \
 && ninja -C build kvtrie-server kvtrie

FROM debian:12-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libgrpc++1.51 libgrpc29 libprotobuf32 librocksdb7.8 libspdlog1.10 libfmt9 libzstd1 \
      libxxhash0 libabsl20220623 libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 \
      ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /var/lib/kvtrie kvtrie \
 && mkdir -p /var/lib/kvtrie && chown kvtrie /var/lib/kvtrie
COPY --from=build /src/build/server/kvtrie-server /src/build/client/kvtrie /usr/local/bin/
USER kvtrie
VOLUME /var/lib/kvtrie
EXPOSE 50051
# SIGTERM drains (health NOT_SERVING, grace period, flush) and exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/kvtrie-server", "--listen=0.0.0.0:50051", "--data_dir=/var/lib/kvtrie"]
