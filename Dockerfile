# The identityd agent's image: the binary alone, static (CGO off), on an
# empty base. `make image` builds it; deploy/ runs it.
#
# The builder is any image with the Go toolchain of go.mod on its PATH
# (GO_IMAGE). Every RUN is in exec form, so the builder needs no shell.
ARG GO_IMAGE=golang:1.26
FROM ${GO_IMAGE} AS build
ENV CGO_ENABLED=0 GOTOOLCHAIN=local
WORKDIR /src
COPY go.mod go.sum ./
RUN ["go", "mod", "download"]
COPY . .
# The version `identityd version` prints (main.version).
ARG VERSION=dev
ENV GOFLAGS="-trimpath -ldflags=-X=main.version=${VERSION}"
RUN ["go", "build", "-o", "/out/identityd", "./cmd/identityd"]

FROM scratch
COPY --from=build /out/identityd /usr/local/bin/identityd
ENV PATH=/usr/local/bin
# Root, without a capability but the ones the pod adds: the state
# directory and the pinned BPF map on the host are root's, and creating
# the map takes CAP_BPF (deploy/base/daemonset.yaml).
USER 0:0
ENTRYPOINT ["/usr/local/bin/identityd"]
