# identityd — build, run and test. Only Go is needed; everything else
# (etcd servers and a Kubernetes API server for the tests, staticcheck) is
# built from Go modules.

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
# Rounds of `make bench-anchor` (identityd against Cilium v1.16.2's code),
# and runs per process (1: the figure of a fresh process; 3: the median is
# a run on a heap that an earlier run grew).
ANCHOR_ROUNDS ?= 6
ANCHOR_COUNT  ?= 1
# Rounds of `make bench-cilium` (each races both sides once).
CILIUM_ROUNDS ?= 4
# Rounds of `make bench-cilium-mixed` (a fresh API server each).
MIXED_ROUNDS ?= 5
# Length of the fault-injection workload of `make robustness` (empty: the
# short run of about a minute that `make test` also runs).
ROBUSTNESS_DURATION ?=
# Global store of the agents in `make robustness`: kvstore (etcd), crd (a
# Kubernetes API server on the etcd cluster, --identity-allocation-mode=crd)
# or all (both, one after the other).
ROBUSTNESS_MODE ?= kvstore
ROBUSTNESS_RUN_kvstore := ^TestRobustness$$
ROBUSTNESS_RUN_crd     := ^TestRobustnessCRD$$
ROBUSTNESS_RUN_all     := ^TestRobustness(CRD)?$$
STATICCHECK_VERSION := v0.8.2
# `make image`: the image's name, the container builder (podman, else
# docker), the version `identityd version` prints, the builder stage's Go
# image (empty: the Dockerfile's), and further flags for the builder.
IMAGE ?= identityd:latest
CONTAINER_BUILDER ?= $(shell command -v podman 2>/dev/null || command -v docker 2>/dev/null)
VERSION ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
GO_IMAGE ?=
IMAGE_BUILD_FLAGS ?=

.PHONY: all build image run shell test test-long vet vet-servers fmt-check test-binaries test-unit compose-example bench bench-anchor anchor-labels bench-churn bench-fullrange bench-cilium bench-cilium-mixed bench-scale bench-relabel interop-cilium fuzz robustness lint docs-graph clean

all: build

build:
	$(GO) build -o $(BIN) ./cmd/identityd

# Builds the agent's container image (Dockerfile: a static binary on an
# empty base), which deploy/ runs; docs/guides.md, "Running on
# Kubernetes".
image:
	$(if $(CONTAINER_BUILDER),,$(error make image needs podman or docker; set CONTAINER_BUILDER))
	$(CONTAINER_BUILDER) build --build-arg VERSION=$(VERSION) $(if $(GO_IMAGE),--build-arg GO_IMAGE=$(GO_IMAGE)) $(IMAGE_BUILD_FLAGS) -t $(IMAGE) .

# Runs the agent on the embedded etcd with everything it writes under
# $(STATE_DIR); needs no root and no external service. Ctrl-C stops it.
# The datapath map is the file in $(STATE_DIR), also as root: the BPF map
# would be pinned on the host's bpffs, one for every state directory
# (RUN_FLAGS=--ipcache-map=bpf asks for it).
run: build
	exec ./$(BIN) --state-dir $(STATE_DIR) --ipcache-map=file $(RUN_FLAGS)

# Opens a shell into the agent started by `make run` (CMD="identity/list"
# runs one command).
shell: build
	./$(BIN) shell --state-dir $(STATE_DIR) $(if $(CMD),-- $(CMD))

# CI runs `make test`, `make vet` and `make test-long`, in that order.
test: fmt-check test-binaries test-unit compose-example

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go' -not -path './.bin/*')); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

# A fresh machine compiles the dependencies in two build modes: -race, for
# the tests, and the image's (CGO_ENABLED=0 -trimpath), in which
# internal/testproc builds the test servers and the agents that tests run
# as processes. vet compiles the tested packages with -race, as test-unit
# does (the files for builds without -race, each one constant, are left
# out), so after `make test` only the analysis is left. It is not part of
# `make test`: vet analyzes every dependency of the tested packages too,
# which on a fresh machine takes a third as much CPU as compiling them
# (docs/benchmarks.md, "make test time"). CI runs it.
vet:
	$(GO) vet -race $(TEST_PKGS)

# The two test-server mains, which no race test binary builds, vetted in
# the mode internal/testproc builds them in, the API server's in its own
# module (internal/k8stest/kubeapiserver). Not part of `make test`: vet analyzes every
# package they import, the Kubernetes API server libraries included,
# which on a fresh machine takes more CPU than compiling them
# (docs/benchmarks.md, "make test time"); `make lint` runs it.
vet-servers:
	CGO_ENABLED=0 $(GO) run -trimpath ./internal/testproc/testbins -vet

# The test etcd server (internal/etcdtest/etcdserver) has no tests of its
# own: `go test` would compile it with -race only to print "no test
# files". The tests build it without -race (internal/testproc); `make
# vet-servers` (part of `make lint`) vets it. The API server is a module
# of its own, kept in internal/k8stest/kubeapiserver as go.mod.in,
# go.sum.in and main.go.in (testproc.ModuleSource writes it out), which
# `go list ./...` does not list.
#
# go test starts packages in the order it is given them, -p at a time.
# The packages whose tests take longest come first, so that the longest
# does not start last; the rest follow in `go list` order. Most of their
# time is waiting for processes (agents, etcd, API servers), so more
# packages run at a time than there are cores (TEST_P). A running test
# binary holds one of go test's -p slots, as a compile or a link does: on
# a fresh machine, with four, the four longest packages held every slot
# while they waited for their processes, and the compiles of the others
# waited for them.
TEST_FIRST := cmd/identityd cells/allocator/crdstore internal/restarttest cells/allocator/etcdstore internal/robustness cells/kvstore cells/allocator/doublewrite cells/k8sclient
TEST_P ?= 6
TEST_PKGS = $$(mod=$$($(GO) list -m); for p in $(TEST_FIRST); do echo $$mod/$$p; done; \
	$(GO) list ./... | grep -v -x $(foreach p,$(TEST_FIRST),-e "$$mod/$(p)") -e '.*/internal/etcdtest/etcdserver')

# The binaries the tests run as processes (the test etcd and API servers,
# the agent), built as internal/testproc builds them on first use, before
# the first test starts: on a fresh machine, building them while go test
# built and ran the race-built tests took an eighth more CPU in all, and
# the first tests waited for them (docs/benchmarks.md, "make test time").
# With warm caches it only links the agent.
test-binaries:
	CGO_ENABLED=0 $(GO) run -trimpath ./internal/testproc/testbins

# go test's own vet checks are a subset of `make vet`'s, and would
# analyze every dependency as well: -vet=off leaves vet to `make vet`.
# The test binaries are linked without DWARF (-w), which nothing reads
# (stack traces and race reports come from the symbol table), for a
# quarter less link time per test binary.
test-unit:
	$(GO) test -race -vet=off -ldflags=-w -p $(TEST_P) -timeout 20m $(TEST_PKGS)

# The full-size runs of the tests that `make test` runs smaller, for the
# same steps and checks: the rolling migration between the stores with
# 2,000 global identities instead of 300 (internal/modemigration), the CRD
# store's three-node race on 2,000 new label sets instead of 600, and 200
# kills of a checkpoint writer instead of 60; and the exhaustion of a CRD
# range at the allocator (32,512 CiliumIdentity objects, over a minute),
# which `make test` does not run. CI runs it after `make test`; with make
# test's build cache it takes about two minutes, and the CRD exhaustion run
# one and a half more (98 s on a loaded 2-core machine). The workloads
# acceptance (cmd/identityd) runs with 3,000 pods instead of 300: about
# 66 s for its two modes side by side; the identity manager's test and the
# rolling switch of the management mode run in kvstore mode too (`make
# test` runs them in crd mode), and the operator-mode acceptance (three
# agents, two manager replicas, 300 pods, then 2,000 with a SIGKILL of the
# Lease's holder half way) runs only here, in both modes.
test-long:
	MODEMIGRATION_SETS=2000 CRDSTORE_RACE_SETS=2000 CHECKPOINT_CRASH_RUNS=200 ALLOCATOR_CRD_EXHAUSTION=1 WORKLOADS_PODS=3000 CRDSTORE_LATER_MARKS=1 MANAGER_KVSTORE=1 MANAGER_TAKEOVER=1 \
	$(GO) test -race -vet=off -ldflags=-w -count=1 -timeout 20m \
	  -run '^(TestRollingModeMigration|TestRaceNoDuplicates|TestCrashSafety|TestSpaceExhaustedCRD|TestWorkloadsCRD|TestWorkloadsKVStore|TestFullRangeWalkWaitsForLaterMarks|TestOperatorModeManagerKVStore|TestManagementModeRollingSwitchKVStore|TestOperatorModeAcceptance|TestOperatorModeAcceptanceKVStore)$$' \
	  ./internal/modemigration ./cells/allocator/crdstore ./cells/checkpoint ./cells/allocator ./cmd/identityd

# The compose example is its own module that imports the cells from
# outside, so the public API stays nameable by other agents. It is built
# with -race, the mode the tests compiled every package it imports in: a
# plain build would compile them all once more.
compose-example:
	cd docs/examples/compose && GOFLAGS=-mod=mod $(GO) build -race -o /dev/null .

bench:
	$(GO) test -run '^$$' -bench '$(BENCH)' -benchmem -count $(BENCHCOUNT) ./...

# Runs the local allocator benchmarks of identityd and of Cilium v1.16.2's
# own code (internal/ciliumanchor, a module of its own) in alternating
# processes and prints the multiple of every round. Downloads Cilium's
# module on first use.
bench-anchor:
	@dir=$$(mktemp -d) && trap 'rm -rf "$$dir"' EXIT && \
	$(GO) test -c -o "$$dir/identityd.test" ./cells/allocator && \
	cd internal/ciliumanchor && $(GO) test -c -o "$$dir/cilium.test" . && \
	$(GO) run ./compare -rounds $(ANCHOR_ROUNDS) -count $(ANCHOR_COUNT) "$$dir/identityd.test" "$$dir/cilium.test"

# Runs TestChurnLevelsOff of both stores, and TestChurnLevelsOffProcess,
# the same against two identityd processes per store (docs/benchmarks.md,
# "Identity churn"): two nodes allocate CHURN_RATE new label sets a second
# each, held 10 s, for CHURN_SECONDS, collecting every CHURN_GC_INTERVAL
# seconds at CHURN_GC_LIMIT deletions a minute, the CRD store's heartbeat
# timeout CHURN_HEARTBEAT_TIMEOUT seconds; the identities must level off.
CHURN_SECONDS ?= 300
CHURN_RATE ?= 40
CHURN_GC_INTERVAL ?= 10
CHURN_GC_LIMIT ?= 2500
CHURN_HEARTBEAT_TIMEOUT ?= 120
bench-churn:
	IDENTITYD_CHURN_SECONDS=$(CHURN_SECONDS) IDENTITYD_CHURN_RATE=$(CHURN_RATE) \
	IDENTITYD_CHURN_GC_INTERVAL=$(CHURN_GC_INTERVAL) IDENTITYD_CHURN_GC_LIMIT=$(CHURN_GC_LIMIT) \
	IDENTITYD_CHURN_HEARTBEAT_TIMEOUT=$(CHURN_HEARTBEAT_TIMEOUT) \
	$(GO) test -count=1 -p 1 -timeout 3h -run '^TestChurnLevelsOff(Process)?$$' -v \
	  ./cells/allocator/etcdstore ./cells/allocator/crdstore ./cmd/identityd

# Fills a cluster's whole CRD range (65,280 IDs) through an agent's shell,
# releases FULLRANGE_RELEASED label sets and times how soon as many new
# ones get IDs (docs/benchmarks.md, "A full range recovering").
FULLRANGE_RELEASED ?= 1000
bench-fullrange:
	IDENTITYD_FULLRANGE_RELEASED=$(FULLRANGE_RELEASED) \
	$(GO) test -count=1 -timeout 60m -run '^TestFullRangeRecoversProcess$$' -v ./cmd/identityd

# Checks the identity labels Cilium v1.16.2's own agent code gives the pod
# shapes of cells/workloads/testdata against the file that make test
# compares identityd's rule with (TestSameLabelsAsCilium);
# ANCHOR_UPDATE=1 rewrites the file from Cilium's code. Downloads and
# builds Cilium's module on first use (minutes).
anchor-labels:
	cd internal/ciliumanchor && $(GO) test -count=1 -run '^TestPodLabelsAsCilium$$' . $(if $(ANCHOR_UPDATE),-update)

# Runs identityd's CRD store and Cilium v1.16.2's own CRD-mode identity
# allocator (internal/ciliumanchor/crdnode, built as a process of its own)
# on one Kubernetes API server, and checks that they share identities with
# equal IDs (TestCiliumInterop, which `make test` skips). Downloads Cilium's
# module on first use.
interop-cilium:
	IDENTITYD_CILIUM_INTEROP=1 $(GO) test -run '^TestCiliumInterop$$' -count 1 -v -timeout 15m ./cells/allocator/crdstore

# Races three Cilium v1.16.2 agents in CRD mode (crdnode) and three identityd
# nodes, each side on a fresh API server, on 2,000 new label sets, 8 at a
# time per node (BenchmarkCiliumThreeNodes): distinct identities per second
# of each and their ratio, in one run. Downloads Cilium's module on first use.
bench-cilium:
	IDENTITYD_CILIUM_INTEROP=1 $(GO) test -run '^$$' -bench '^BenchmarkCiliumThreeNodes$$' -benchtime $(CILIUM_ROUNDS)x -count 1 -timeout 60m ./cells/allocator/crdstore

# The mixed race (BenchmarkCiliumMixed): two identityd nodes at
# --k8s-client-qps=40, one behind a proxy that delays each direction by
# 50 ms, and two Cilium v1.16.2 agents (crdnode) allocate the same 2,000 new
# label sets on one API server; then a late identityd node and a late
# Cilium agent allocate them again. Reports the sets the identityd nodes
# answer differently and the identityd nodes not ready at the end (both
# want 0), and the late nodes' times. About 2 minutes a round on two
# cores; downloads Cilium's module on first use.
bench-cilium-mixed:
	IDENTITYD_CILIUM_INTEROP=1 $(GO) test -run '^$$' -bench '^BenchmarkCiliumMixed$$' -benchtime $(MIXED_ROUNDS)x -count 1 -timeout 120m ./cells/allocator/crdstore

# Runs the cluster scale benchmark (internal/scalebench, BenchmarkScale,
# which other targets skip): N simulated nodes of each store, every node with
# its own connection, against a real etcd and a real API server, counting at
# the servers what a steady window and a churn window cost, for N = 8 to
# 128, and the extrapolation to 1,000 and 5,000 nodes (docs/benchmarks.md,
# "Cluster scale"). About 2 hours on two cores; N = 128 needs 9 GB of
# memory in crd mode. SCALE_NODES, SCALE_MODES,
# SCALE_IDENTITIES, SCALE_WINDOW, SCALE_SAVE, SCALE_LOAD and the other
# SCALE_* variables of the package's documentation change the sweep.
bench-scale:
	IDENTITYD_BENCH_SCALE=1 $(GO) test -run '^$$' -bench '^BenchmarkScale$$' -benchtime 1x -count 1 -timeout 8h ./internal/scalebench

# Runs the relabel storm (internal/scalebench,
# BenchmarkRelabelStorm, which other targets skip): N simulated nodes, each
# with the allocator, the store and the workloads cell on a client of its
# own, against a real kube-apiserver; 20,000 pods bound to the nodes, half
# of them in one namespace whose label then changes, so that each of those
# pods needs a new identity. Reports the time until every pod is on its new
# identity, duplicate identities, the requests and watch events the
# servers counted by kind, the CiliumIdentity WATCH requests against
# nodes+20 and the growth of the totals over N (docs/benchmarks.md,
# "Relabel storm"). The default is the issue's full size, N = 8 to 64 in
# crd mode: about 7 minutes on two cores. RELABEL_MODES (crd, etcd),
# RELABEL_NODES, RELABEL_PODS, RELABEL_NAMESPACES, RELABEL_DEPLOYMENTS,
# RELABEL_GRACE and RELABEL_TIMEOUT change it.
bench-relabel:
	IDENTITYD_BENCH_RELABEL=1 $(GO) test -run '^$$' -bench '^BenchmarkRelabelStorm$$' -benchtime 1x -count 1 -timeout 8h ./internal/scalebench

# Runs the fault-injection test: 3 etcd members and 3 agents as processes,
# a random workload, faults, and the checker over the history
# (ROBUSTNESS_DURATION=20m for a long run; ROBUSTNESS_SEED repeats a run;
# ROBUSTNESS_MODE=crd for the agents in CRD mode).
robustness:
	$(if $(ROBUSTNESS_RUN_$(ROBUSTNESS_MODE)),,$(error ROBUSTNESS_MODE must be kvstore, crd or all, not "$(ROBUSTNESS_MODE)"))
	ROBUSTNESS_MODE=$(ROBUSTNESS_MODE) ROBUSTNESS_DURATION=$(ROBUSTNESS_DURATION) $(GO) test -run '$(ROBUSTNESS_RUN_$(ROBUSTNESS_MODE))' -count 1 -v -timeout $(if $(ROBUSTNESS_DURATION),2h,10m) ./internal/robustness
	IDENTITYD_KILL_ROUNDS=20 $(GO) test -run '^TestKillDuringDurableAnswers$$' -count 1 -v -timeout 20m ./internal/restarttest

# Runs every fuzz target for $(FUZZTIME) each. Packages come from `go list`,
# so nested modules (docs/examples) and testdata are left out; `go test
# -fuzz` takes one target per run.
fuzz:
	@set -e; for dir in $$($(GO) list -f '{{.Dir}}' ./...); do \
	  for t in $$(grep -ho '^func Fuzz[A-Za-z0-9_]*' $$dir/*_test.go 2>/dev/null | sed 's/^func //'); do \
	    echo "== $$dir $$t"; \
	    $(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $(FUZZTIME) $$dir; \
	  done; \
	done

.bin/staticcheck:
	GOBIN=$(CURDIR)/.bin $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

lint: fmt-check vet vet-servers .bin/staticcheck
	./.bin/staticcheck ./...

# Regenerates docs/cells.svg, the cell graph of docs/architecture.md, from
# the agent's own hive. Needs Graphviz (dot), which nothing else needs, so
# no other target depends on this one.
docs-graph: build
	./$(BIN) hive dot-graph | $(GO) run ./internal/cellgraph | dot -Tsvg -o docs/cells.svg

clean:
	rm -rf bin .bin
