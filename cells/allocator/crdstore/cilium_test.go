package crdstore

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/crdclient"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/idprobe"
	"github.com/identityd/identityd/internal/k8stest"
	"github.com/identityd/identityd/internal/testproc"
	"github.com/identityd/identityd/labels"
)

// ciliumInteropEnv asks for the interop test with Cilium v1.16.2's own CRD
// allocator (`make interop-cilium`). It is off by default because it builds
// Cilium (internal/ciliumanchor/crdnode, a module of its own).
const ciliumInteropEnv = "IDENTITYD_CILIUM_INTEROP"

// ciliumBinaryEnv names a crdnode binary to use instead of building one.
const ciliumBinaryEnv = "IDENTITYD_CILIUM_CRDNODE"

// ciliumBinary builds internal/ciliumanchor/crdnode once per source and
// toolchain into the user cache directory, as testproc does for the
// servers of the main module.
func ciliumBinary(t testing.TB) string {
	t.Helper()
	if p := os.Getenv(ciliumBinaryEnv); p != "" {
		return p
	}
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatalf("go env GOMOD: %v", err)
	}
	mod := filepath.Join(filepath.Dir(strings.TrimSpace(string(out))), "internal", "ciliumanchor")
	h := sha256.New()
	files := []string{filepath.Join(mod, "go.mod"), filepath.Join(mod, "go.sum")}
	srcs, _ := filepath.Glob(filepath.Join(mod, "crdnode", "*.go"))
	slices.Sort(srcs)
	for _, f := range append(files, srcs...) {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(h, "%s %d\n", filepath.Base(f), len(b))
		h.Write(b)
	}
	ver, _ := exec.Command("go", "env", "GOVERSION").Output()
	h.Write(ver)
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	dir := filepath.Join(cache, "identityd-testbin")
	bin := filepath.Join(dir, "cilium-crdnode-"+hex.EncodeToString(h.Sum(nil))[:16])
	if fi, err := os.Stat(bin); err == nil && fi.Mode()&0o111 != 0 {
		return bin
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	tmp := fmt.Sprintf("%s.tmp%d", bin, os.Getpid())
	cmd := exec.Command("go", "build", "-o", tmp, "./crdnode")
	cmd.Dir = mod
	start := time.Now()
	if b, err := cmd.CombinedOutput(); err != nil {
		os.Remove(tmp)
		t.Fatalf("building Cilium's crdnode: %v\n%s", err, b)
	}
	if err := os.Rename(tmp, bin); err != nil {
		t.Fatal(err)
	}
	t.Logf("built %s in %s", bin, time.Since(start).Round(time.Second))
	return bin
}

// ciliumAnswer is crdnode's answer for one label set.
type ciliumAnswer struct {
	id  identity.NumericIdentity
	key string // the label set's key as Cilium's allocator writes it
	err string // Cilium gave up
}

// ciliumAgent is a running crdnode process: Cilium v1.16.2's
// CachingIdentityAllocator in CRD mode with its CiliumIdentity informer.
type ciliumAgent struct {
	t      testing.TB
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string
	logDir string
	done   chan struct{}
}

func startCilium(t testing.TB, bin, kubeconfig string, args ...string) *ciliumAgent {
	t.Helper()
	dir := t.TempDir()
	logf, err := os.Create(filepath.Join(dir, "crdnode.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, append([]string{"-kubeconfig", kubeconfig}, args...)...)
	cmd.Stderr = logf
	testproc.SetDeathSignal(cmd)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	a := &ciliumAgent{t: t, cmd: cmd, stdin: stdin, lines: make(chan string, 64), logDir: dir, done: make(chan struct{})}
	go func() {
		defer close(a.lines)
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			a.lines <- sc.Text()
		}
	}()
	t.Cleanup(func() {
		a.stdin.Close()
		select {
		case <-a.done:
		default:
			cmd.Process.Kill()
			cmd.Wait()
		}
		logf.Close()
		if t.Failed() {
			t.Logf("crdnode %v log:\n%s", args, testproc.TailFile(logf.Name(), 16<<10))
		}
	})
	return a
}

// ciliumInput is a label set as crdnode reads it: a JSON array of labels in
// text form, parsed by Cilium's labels.NewLabelsFromModel.
func ciliumInput(lbls labels.Labels) string {
	strs := make([]string, len(lbls))
	for i, l := range lbls {
		strs[i] = l.Source + ":" + l.Key + "=" + l.Value
	}
	b, _ := json.Marshal(strs)
	return string(b)
}

// ask sends one label set and waits for Cilium's answer.
func (a *ciliumAgent) ask(lbls labels.Labels) ciliumAnswer {
	a.t.Helper()
	if _, err := io.WriteString(a.stdin, ciliumInput(lbls)+"\n"); err != nil {
		a.t.Fatalf("writing to crdnode: %v", err)
	}
	select {
	case line, ok := <-a.lines:
		if !ok {
			a.t.Fatalf("crdnode exited before answering %s", lbls)
		}
		return parseAnswer(a.t, line)
	case <-time.After(3 * time.Minute):
		a.t.Fatalf("crdnode did not answer %s", lbls)
	}
	return ciliumAnswer{}
}

func parseAnswer(t testing.TB, line string) ciliumAnswer {
	t.Helper()
	f := strings.SplitN(line, "\t", 3)
	if f[0] == "error" && len(f) == 3 {
		return ciliumAnswer{key: f[1], err: f[2]}
	}
	if len(f) != 2 {
		t.Fatalf("crdnode answered %q", line)
	}
	n, err := strconv.ParseUint(f[0], 10, 32)
	if err != nil {
		t.Fatalf("crdnode answered %q", line)
	}
	return ciliumAnswer{id: identity.NumericIdentity(n), key: f[1]}
}

// close ends the input and waits for the process to exit.
func (a *ciliumAgent) close() {
	a.t.Helper()
	a.stdin.Close()
	for range a.lines {
	}
	err := a.cmd.Wait()
	close(a.done)
	if err != nil {
		a.t.Fatalf("crdnode: %v\n%s", err, testproc.TailFile(filepath.Join(a.logDir, "crdnode.log"), 16<<10))
	}
}

// runCilium starts a fresh Cilium agent (its informer lists what is there
// now), asks it every set in order and stops it.
func runCilium(t *testing.T, bin, kubeconfig string, sets []labels.Labels, args ...string) []ciliumAnswer {
	t.Helper()
	a := startCilium(t, bin, kubeconfig, args...)
	out := make([]ciliumAnswer, len(sets))
	for i, s := range sets {
		out[i] = a.ask(s)
	}
	a.close()
	return out
}

// interopShape is a kind of label set that both Cilium and identityd
// accept. refused lists the metadata.labels keys that Cilium selects but
// the API server refuses.
type interopShape struct {
	name    string
	labels  func(ns string) labels.Labels
	refused []string
}

func interopShapes() []interopShape {
	long := func(n int) string { return strings.Repeat("v", n) }
	return []interopShape{
		{name: "pod", labels: func(ns string) labels.Labels {
			return labels.MustParse("k8s:app=web", "k8s:app.kubernetes.io/name=web", "k8s:io.kubernetes.pod.namespace="+ns,
				"k8s:io.cilium.k8s.policy.serviceaccount=default", "k8s:io.cilium.k8s.policy.cluster=default")
		}},
		{name: "namespace-labels", labels: func(ns string) labels.Labels {
			return labels.MustParse("k8s:app=db", "k8s:io.kubernetes.pod.namespace="+ns,
				"k8s:io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name="+ns,
				"k8s:io.cilium.k8s.namespace.labels.team=blue",
				"k8s:io.cilium.k8s.namespace.labels.note=a=b c $d #e",
				"k8s:io.cilium.k8s.namespace.labels."+strings.Repeat("k", 80)+"="+long(100))
		}},
		{name: "empty-value", labels: func(ns string) labels.Labels {
			return labels.MustParse("k8s:flag", "k8s:io.kubernetes.pod.namespace="+ns, "container:empty")
		}},
		{name: "other-sources", labels: func(ns string) labels.Labels {
			return labels.MustParse("k8s:io.kubernetes.pod.namespace="+ns, "container:cmd=a=b", "container:price=$5",
				"container:tag=#1", "container:msg=hello world", "unspec:plain=1", "mesos:task=t1")
		}},
		{name: "long-values", labels: func(ns string) labels.Labels {
			return labels.MustParse("k8s:io.kubernetes.pod.namespace="+ns, "k8s:app="+long(63),
				"unspec:long="+long(300), "container:longer="+long(2000))
		}},
		{name: "k8s-values-refused", labels: func(ns string) labels.Labels {
			return labels.MustParse("k8s:app=web", "k8s:io.kubernetes.pod.namespace="+ns, "k8s:selector=a=b",
				"k8s:note=hello world", "k8s:price=$5", "k8s:tag=#1")
		}, refused: []string{"note", "price", "selector", "tag"}},
		{name: "k8s-long-value-refused", labels: func(ns string) labels.Labels {
			return labels.MustParse("k8s:io.kubernetes.pod.namespace="+ns, "k8s:long="+long(64))
		}, refused: []string{"long"}},
		{name: "k8s-key-refused", labels: func(ns string) labels.Labels {
			return labels.MustParse("k8s:io.kubernetes.pod.namespace="+ns, "k8s:bad:key=1", "k8s:"+strings.Repeat("k", 64)+"=1")
		}, refused: []string{"bad:key", strings.Repeat("k", 64)}},
	}
}

// ciliumSelects is the metadata.labels Cilium v1.16's CRD backend writes
// for lbls (identitybackend.SanitizeK8sLabels): every k8s label but the
// namespace labels, without the "k8s:" prefix. The test checks it against
// the objects Cilium writes.
func ciliumSelects(lbls labels.Labels) map[string]string {
	m := map[string]string{}
	for _, l := range lbls {
		if l.Source == labels.SourceK8s && !strings.HasPrefix(l.Key, namespaceLabelsPrefix) {
			m[l.Key] = l.Value
		}
	}
	return m
}

// substituted returns m with every value old replaced by new.
func substituted(m map[string]string, old, new string) map[string]string {
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[k] = strings.ReplaceAll(v, old, new)
	}
	return out
}

func nonNil(m map[string]string) map[string]string {
	if m == nil {
		return map[string]string{}
	}
	return m
}

// TestCiliumInterop runs identityd's CRD store and Cilium v1.16.2's own CRD
// allocator (crdnode, as processes) on one API server, and checks that
// each sees, creates and adopts the other's identities with equal IDs,
// that identityd writes the objects Cilium writes, that each removes the
// heartbeat mark of an identity it takes, and records which object each
// picks when one label set has two.
func TestCiliumInterop(t *testing.T) {
	if os.Getenv(ciliumInteropEnv) != "1" {
		t.Skipf("set %s=1 (make interop-cilium) to build Cilium v1.16.2's CRD allocator (internal/ciliumanchor/crdnode) and run identityd's CRD store against it", ciliumInteropEnv)
	}
	bin := ciliumBinary(t)
	srv := k8stest.Start(t)
	kc := srv.Kubeconfig()
	cli := newClient(t, srv.RESTConfig())
	ext, err := crdclient.New(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}

	// Cilium's operator installs its CRD; identityd leaves it as it is.
	runCilium(t, bin, kc, nil, "-register-crd", "-lookup")
	crd, err := ext.Get(t.Context(), CiliumIdentityCRDName)
	if err != nil {
		t.Fatal(err)
	}
	node := startNode(t, srv.RESTConfig(), "node-1")
	after, err := ext.Get(t.Context(), CiliumIdentityCRDName)
	if err != nil {
		t.Fatal(err)
	}
	if after.ResourceVersion != crd.ResourceVersion {
		t.Errorf("identityd rewrote Cilium's CiliumIdentity CRD (resourceVersion %s -> %s)", crd.ResourceVersion, after.ResourceVersion)
	}

	shapes := interopShapes()
	setsOf := func(ns string) []labels.Labels {
		out := make([]labels.Labels, len(shapes))
		for i, s := range shapes {
			out[i] = s.labels(ns)
		}
		return out
	}
	aSets, bSets := setsOf("ns-a"), setsOf("ns-b")
	objects := func() int { return len(cli.identities(t)) }

	// identityd creates set A; Cilium finds and adopts the same IDs.
	aIDs := make([]identity.NumericIdentity, len(aSets))
	aObjs := make([]*CiliumIdentity, len(aSets))
	for i, s := range aSets {
		id, created := node.allocate(t, s)
		if !created {
			t.Fatalf("%s: identityd adopted %d for a new label set", shapes[i].name, id)
		}
		aIDs[i] = id
		if aObjs[i], err = cli.identity(t, id); err != nil {
			t.Fatal(err)
		}
		// Placement: the first slot of the label set's probe sequence
		// that no other label set holds.
		p := idprobe.New(s.Canonical(), node.store.cluster)
		for j := uint64(0); p.Slot(j) != id; j++ {
			if e := node.store.ids.get(p.Slot(j)); e == nil || e.key == s.Canonical() {
				t.Errorf("%s: identityd created %d, but slot %d (%d) of its probe sequence was free", shapes[i].name, id, j, p.Slot(j))
				break
			}
		}
	}
	n := objects()
	for _, mode := range [][]string{{"-lookup"}, nil} {
		for i, ans := range runCilium(t, bin, kc, aSets, mode...) {
			if ans.err != "" || ans.id != aIDs[i] {
				t.Errorf("%s %v: Cilium answered %d (%s) for identityd's %d", shapes[i].name, mode, ans.id, ans.err, aIDs[i])
			}
			if ans.key != aSets[i].Canonical() {
				t.Errorf("%s: Cilium's key %q, identityd's canonical labels %q", shapes[i].name, ans.key, aSets[i].Canonical())
			}
		}
	}
	if got := objects(); got != n {
		t.Errorf("Cilium created %d objects for label sets identityd had created", got-n)
	}

	// Cilium creates set B; identityd adopts the same IDs once they are
	// older than walkHeadStart (younger, off the sets' sequences, they
	// would lose to objects identityd creates there). Where Cilium copies
	// into metadata.labels what the API server refuses, its create fails;
	// identityd's succeeds, and Cilium then adopts identityd's.
	bAnswers := runCilium(t, bin, kc, bSets, "-timeout", "10s")
	for _, ans := range bAnswers {
		if ans.err != "" {
			continue
		}
		obj, err := cli.identity(t, ans.id)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Until(obj.CreationTimestamp.Add(walkHeadStart + 3*time.Second)))
	}
	var refusedSets []labels.Labels
	var refusedIDs []identity.NumericIdentity
	for i, s := range bSets {
		sh, ans := shapes[i], bAnswers[i]
		if len(sh.refused) > 0 {
			if ans.err == "" {
				t.Errorf("%s: Cilium created %d; the API server should refuse its metadata.labels", sh.name, ans.id)
				continue
			}
			// The API server names each refused label by its key, or
			// by its value when only the value is refused.
			for _, k := range sh.refused {
				v, _ := s.Get(k)
				if !strings.Contains(ans.err, "metadata.labels") ||
					(!strings.Contains(ans.err, strconv.Quote(k)) && !strings.Contains(ans.err, strconv.Quote(v.Value))) {
					t.Errorf("%s: Cilium's failure does not name metadata.labels %q: %s", sh.name, k, ans.err)
				}
			}
			t.Logf("%s: Cilium's create fails: %s", sh.name, ans.err)
			id, created := node.allocate(t, s)
			if !created {
				t.Errorf("%s: identityd adopted %d, want a new identity", sh.name, id)
			}
			obj, err := cli.identity(t, id)
			if err != nil {
				t.Fatal(err)
			}
			if want := securityLabels(s); !maps.Equal(obj.SecurityLabels, want) {
				t.Errorf("%s: identityd wrote security-labels %v, want %v", sh.name, obj.SecurityLabels, want)
			}
			want := ciliumSelects(s)
			for _, k := range sh.refused {
				delete(want, k)
			}
			if !maps.Equal(nonNil(obj.Labels), want) {
				t.Errorf("%s: identityd wrote metadata.labels %v, want Cilium's selection without the refused %v: %v", sh.name, obj.Labels, sh.refused, want)
			}
			refusedSets, refusedIDs = append(refusedSets, s), append(refusedIDs, id)
			continue
		}
		if ans.err != "" {
			t.Errorf("%s: Cilium failed: %s", sh.name, ans.err)
			continue
		}
		if ans.key != s.Canonical() {
			t.Errorf("%s: Cilium's key %q, identityd's canonical labels %q", sh.name, ans.key, s.Canonical())
		}
		require(t, 30*time.Second, func() error {
			if id, ok := node.store.LookupByLabels(s); !ok || id != ans.id {
				return fmt.Errorf("%s: identityd's cache has %d (%v), Cilium created %d", sh.name, id, ok, ans.id)
			}
			return nil
		})
		if id, created := node.allocate(t, s); id != ans.id || created {
			t.Errorf("%s: identityd allocated %d (created %v), Cilium created %d", sh.name, id, created, ans.id)
		}
		// The same shape, written by each side: only the namespace differs.
		cObj, err := cli.identity(t, ans.id)
		if err != nil {
			t.Fatal(err)
		}
		iObj := aObjs[i]
		if got, want := substituted(iObj.SecurityLabels, "ns-a", "ns-b"), cObj.SecurityLabels; !maps.Equal(got, want) {
			t.Errorf("%s: security-labels: identityd writes %v, Cilium %v", sh.name, got, want)
		}
		if got, want := substituted(nonNil(iObj.Labels), "ns-a", "ns-b"), nonNil(cObj.Labels); !maps.Equal(got, want) {
			t.Errorf("%s: metadata.labels: identityd writes %v, Cilium %v", sh.name, got, want)
		}
		if got, want := nonNil(cObj.Labels), ciliumSelects(s); !maps.Equal(got, want) {
			t.Errorf("%s: Cilium wrote metadata.labels %v, the rule says %v", sh.name, got, want)
		}
		if len(iObj.Annotations) != 0 || len(cObj.Annotations) != 0 {
			t.Errorf("%s: annotations: identityd %v, Cilium %v", sh.name, iObj.Annotations, cObj.Annotations)
		}
	}
	for i, ans := range runCilium(t, bin, kc, refusedSets) {
		if ans.err != "" || ans.id != refusedIDs[i] {
			t.Errorf("Cilium answered %d (%s) for identityd's %d of %s", ans.id, ans.err, refusedIDs[i], refusedSets[i])
		}
	}

	// identityd's record of its uses: its IdentityNode lists every
	// identity it holds, whoever created it; Cilium writes none.
	var held []identity.NumericIdentity
	node.refs.Each(func(r *globalstore.Reference) { held = append(held, r.ID) })
	cli.nodeLists(t, "node-1", held...)
	rec, err := cli.node(t, "node-1")
	if err != nil {
		t.Fatal(err)
	}
	if rec.Spec.LeaseDurationSeconds != int32(DefaultConfig.IdentityNodeLeaseTTL/time.Second) || rec.Spec.RenewTime.IsZero() {
		t.Errorf("IdentityNode node-1: renewTime %v, leaseDurationSeconds %d", rec.Spec.RenewTime, rec.Spec.LeaseDurationSeconds)
	}

	t.Run("heartbeat", func(t *testing.T) {
		// An identity identityd created and no longer uses (its node is
		// gone), marked by Cilium's operator: Cilium's AcquireReference
		// removes the mark.
		other := startNode(t, srv.RESTConfig(), "node-2")
		fromIdentityd := labels.MustParse("k8s:app=heartbeat-1", "k8s:io.kubernetes.pod.namespace=ns-a")
		id1, _ := other.allocate(t, fromIdentityd)
		other.stop()
		cli.mark(t, id1)
		if ans := runCilium(t, bin, kc, []labels.Labels{fromIdentityd})[0]; ans.id != id1 {
			t.Fatalf("Cilium answered %d (%s), identityd created %d", ans.id, ans.err, id1)
		}
		if cli.marked(t, id1) {
			t.Error("Cilium's allocation left the mark on identityd's identity")
		}

		// An identity Cilium created, marked: identityd's allocation
		// removes the mark. Younger than walkHeadStart, an object off
		// the label set's sequence would lose to one identityd creates
		// there: identityd adopts it once it is older.
		fromCilium := labels.MustParse("k8s:app=heartbeat-2", "k8s:io.kubernetes.pod.namespace=ns-b")
		ans := runCilium(t, bin, kc, []labels.Labels{fromCilium})[0]
		if ans.err != "" {
			t.Fatal(ans.err)
		}
		created, err := cli.identity(t, ans.id)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Until(created.CreationTimestamp.Add(walkHeadStart + 3*time.Second)))
		cli.mark(t, ans.id)
		require(t, 30*time.Second, func() error {
			if e := node.store.ids.get(ans.id); e == nil || !e.marked() {
				return errors.New("identityd has not seen the mark")
			}
			return nil
		})
		if id, created := node.allocate(t, fromCilium); id != ans.id || created {
			t.Fatalf("identityd allocated %d (created %v), Cilium created %d", id, created, ans.id)
		}
		if cli.marked(t, ans.id) {
			t.Error("identityd's allocation left the mark on Cilium's identity")
		}
	})

	t.Run("two-objects", func(t *testing.T) {
		testTwoObjects(t, bin, kc, cli, node)
	})
}

// testTwoObjects creates two objects of one label set directly and records
// which one each side picks: identityd by the design's Lookup rule, a
// Cilium agent that was running while they were created, and fresh Cilium
// agents that list them.
func testTwoObjects(t *testing.T, bin, kc string, cli *client, node *testNode) {
	cluster := node.store.cluster
	used := map[identity.NumericIdentity]bool{}
	for _, o := range cli.identities(t) {
		id, _ := strconv.ParseUint(o.Name, 10, 32)
		used[identity.NumericIdentity(id)] = true
	}
	// free returns the first ID from want on that neither holds an
	// object nor is the label set's first slot.
	free := func(want identity.NumericIdentity, first identity.NumericIdentity) identity.NumericIdentity {
		for id := want; ; id++ {
			if !used[id] && id != first {
				used[id] = true
				return id
			}
		}
	}
	createAs := func(lbls labels.Labels, id identity.NumericIdentity) time.Time {
		objLabels, _ := objectLabels(lbls)
		cli.create(t, &CiliumIdentity{ObjectMeta: metav1.ObjectMeta{Name: id.String(), Labels: objLabels}, SecurityLabels: securityLabels(lbls)})
		obj, err := cli.identity(t, id)
		if err != nil {
			t.Fatal(err)
		}
		return obj.CreationTimestamp.Time
	}
	// creationTimestamp counts whole seconds: the second object must be
	// younger by one to be told apart.
	nextSecond := func(after time.Time) {
		for !time.Now().After(after.Add(time.Second + 50*time.Millisecond)) {
			time.Sleep(20 * time.Millisecond)
		}
	}

	cases := []struct {
		name string
		// older and newer are the objects' IDs, created in that order;
		// atFirst puts newer at the label set's first slot.
		older, newer identity.NumericIdentity
		atFirst      bool
	}{
		// Names listed "20000" < "3000": a fresh agent's last listed
		// object is the older one.
		{name: "older-listed-last", older: 3000, newer: 20000},
		// Listed "20001" < "3001": the last listed is the newer one.
		{name: "newer-listed-last", older: 20001, newer: 3001},
		// The newer one at identityd's first slot.
		{name: "newer-at-first-slot", older: 40000, atFirst: true},
	}
	running := startCilium(t, bin, kc, "-lookup")
	for i, c := range cases {
		lbls := labels.MustParse(fmt.Sprintf("k8s:app=split-%d", i), "k8s:io.kubernetes.pod.namespace=ns-split")
		first := idprobe.New(lbls.Canonical(), cluster).Slot(0)
		older := free(c.older, first)
		newer := first
		if !c.atFirst {
			newer = free(c.newer, first)
		} else if used[first] {
			t.Fatalf("%s: the first slot %d is taken", c.name, first)
		}
		if ans := running.ask(lbls); ans.id != 0 {
			t.Fatalf("%s: the running Cilium agent knows %d before any object exists", c.name, ans.id)
		}
		nextSecond(createAs(lbls, older))
		createAs(lbls, newer)
		require(t, 30*time.Second, func() error {
			if node.store.ids.get(older) == nil || node.store.ids.get(newer) == nil {
				return errors.New("identityd has not seen both objects")
			}
			return nil
		})
		idd, _ := node.store.LookupByLabels(lbls)
		// The running agent got the objects by watch, older first.
		var run ciliumAnswer
		require(t, 30*time.Second, func() error {
			if run = running.ask(lbls); run.id != newer {
				return fmt.Errorf("the running Cilium agent answers %d", run.id)
			}
			return nil
		})
		fresh := runCilium(t, bin, kc, []labels.Labels{lbls}, "-lookup")[0]
		freshAlloc := runCilium(t, bin, kc, []labels.Labels{lbls})[0]
		t.Logf("%s: objects %d (older) and %d (newer), identityd's first slot %d: identityd picks %d, a running Cilium agent %d, a fresh one %d (lookup) and %d (allocate)",
			c.name, older, newer, first, idd, run.id, fresh.id, freshAlloc.id)

		// identityd: the oldest, except against an object at its first
		// slot, which counts walkHeadStart older (docs/crd-store.md,
		// Lookup).
		wantIdentityd := older
		if c.atFirst {
			wantIdentityd = newer
		}
		if idd != wantIdentityd {
			t.Errorf("%s: identityd picks %d, its Lookup rule says %d", c.name, idd, wantIdentityd)
		}
		// A fresh Cilium agent keeps the last object its listing
		// delivers for the label set; the API server lists by name.
		lastListed := older
		if newer.String() > older.String() {
			lastListed = newer
		}
		if fresh.id != lastListed || freshAlloc.id != lastListed {
			t.Errorf("%s: fresh Cilium agents pick %d (lookup) and %d (allocate), want the last listed %d", c.name, fresh.id, freshAlloc.id, lastListed)
		}
	}
	running.close()
}
