package k8stest_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/internal/testproc"
)

// TestServerBuildFlagsLeaveSharedPackages checks that every pattern of
// k8stest.ServerBuildFlags names packages the API server imports and none
// that the agent or the test etcd server imports: those are compiled in
// the image's mode for them, and a flag on one would compile it once more
// for the API server.
func TestServerBuildFlagsLeaveSharedPackages(t *testing.T) {
	deps := func(pkgs ...string) []string {
		t.Helper()
		cmd := testproc.InImageMode("list", append([]string{"-deps"}, pkgs...)...)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("%v: %v", cmd.Args, err)
		}
		return strings.Fields(string(out))
	}
	mod := testproc.ModulePath
	shared := deps(testproc.AgentPackage, mod+"/"+etcdtest.ServerPackage)
	server := deps(mod + "/" + k8stest.ServerPackage)
	if len(k8stest.ServerBuildFlags) == 0 {
		t.Fatal("no server build flags")
	}
	for _, flag := range k8stest.ServerBuildFlags {
		pattern, _, ok := strings.Cut(strings.TrimPrefix(flag, "-gcflags="), "=")
		if !ok || !strings.HasPrefix(flag, "-gcflags=") || !strings.HasSuffix(pattern, "/...") {
			t.Errorf("%q: want -gcflags=<path>/...=<flags>", flag)
			continue
		}
		root := strings.TrimSuffix(pattern, "/...")
		matches := func(pkg string) bool { return pkg == root || strings.HasPrefix(pkg, root+"/") }
		var both []string
		for _, pkg := range shared {
			if matches(pkg) {
				both = append(both, pkg)
			}
		}
		if len(both) > 0 {
			t.Errorf("%q matches %d packages that the agent or the etcd server imports: %s", flag, len(both), strings.Join(both[:min(len(both), 3)], ", "))
		}
		if !slices.ContainsFunc(server, matches) {
			t.Errorf("%q matches no package of the API server", flag)
		}
	}
	// The flags take effect: a package under a pattern is compiled with
	// them (go list reports no flags, so ask the build's dry run, of
	// every package, since it leaves out those already in the cache).
	cmd := testproc.InImageMode("build", append(append([]string{"-a", "-n"}, k8stest.ServerBuildFlags...), "k8s.io/api/core/v1")...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %v\n%s", cmd.Args, err, out)
	}
	if !strings.Contains(string(out), "-N -l -dwarf=false") {
		t.Errorf("go build -n of k8s.io/api/core/v1 with the server's flags shows no -N -l -dwarf=false:\n%.2000s", out)
	}
}
