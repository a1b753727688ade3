# identityd — build, run and test. Only Go is needed; everything else
# (etcd servers for the tests, staticcheck) is built from Go modules.

GO        ?= go
BIN       := bin/identityd
STATE_DIR ?= ./.identityd
# Extra flags for `make run`, e.g. RUN_FLAGS="--log-level=debug".
RUN_FLAGS ?=
# How long each fuzz target runs in `make fuzz`.
FUZZTIME  ?= 5s
# Benchmark selection and repetitions for `make bench`.
BENCH     ?= .
BENCHCOUNT ?= 6
STATICCHECK_VERSION := v0.8.2

.PHONY: all build run shell test vet fmt-check test-unit compose-example bench fuzz lint docs-graph clean

all: build

build:
	$(GO) build -o $(BIN) ./cmd/identityd

# Runs the agent on the embedded etcd with its state under $(STATE_DIR);
# needs no root and no external service. Ctrl-C stops it.
run: build
	exec ./$(BIN) --state-dir $(STATE_DIR) $(RUN_FLAGS)

# Opens a shell into the agent started by `make run` (CMD="identity/list"
# runs one command).
shell: build
	./$(BIN) shell --state-dir $(STATE_DIR) $(if $(CMD),-- $(CMD))

test: fmt-check vet test-unit compose-example

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go' -not -path './.bin/*')); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

vet:
	$(GO) vet ./...

test-unit:
	$(GO) test -race -timeout 20m ./...

# The compose example is its own module that imports the cells from
# outside, so the public API stays nameable by other agents.
compose-example:
	cd docs/examples/compose && GOFLAGS=-mod=mod $(GO) build -o /dev/null .

bench:
	$(GO) test -run '^$$' -bench '$(BENCH)' -benchmem -count $(BENCHCOUNT) ./...

# Runs every fuzz target for $(FUZZTIME) each.
fuzz:
	@set -e; for f in $$(grep -rl --include='*_test.go' '^func Fuzz' .); do \
	  pkg=./$$(dirname $$f); \
	  for t in $$(grep -o '^func Fuzz[A-Za-z0-9_]*' $$f | sed 's/^func //'); do \
	    echo "== $$pkg $$t"; \
	    $(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $(FUZZTIME) $$pkg; \
	  done; \
	done

.bin/staticcheck:
	GOBIN=$(CURDIR)/.bin $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

lint: fmt-check vet .bin/staticcheck
	./.bin/staticcheck ./...

# Regenerates docs/cells.svg, the cell graph of docs/architecture.md, from
# the agent's own hive. Needs Graphviz (dot), which nothing else needs, so
# no other target depends on this one.
docs-graph: build
	./$(BIN) hive dot-graph | $(GO) run ./internal/cellgraph | dot -Tsvg -o docs/cells.svg

clean:
	rm -rf bin .bin
