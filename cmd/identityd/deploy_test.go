package main

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/strategicpatch"
	"sigs.k8s.io/yaml"

	"github.com/identityd/identityd/cells/allocator/crdstore"
)

var updateDeploy = flag.Bool("update-deploy", false, "rewrite deploy/crds from the CRDs the binary registers")

// deployDir is the kustomize tree of deploy/: every directory in it with a
// kustomization.yaml is a root `kubectl apply -k` takes.
const deployDir = "../../deploy"

// runtimeEnv are the variables a DaemonSet may set besides IDENTITYD_<flag>:
// the Go runtime's, which identityd's --help does not list.
var runtimeEnv = map[string]bool{"GOMEMLIMIT": true}

// deployObject is one object of a kustomize build, decoded strictly into
// its k8s.io/api type.
type deployObject struct {
	file       string // where it was decoded from, relative to deploy/
	apiVersion string
	kind       string
	obj        metav1.Object
	doc        string // its YAML document, as a patch merges it
}

func (o deployObject) key() string {
	return o.apiVersion + " " + o.kind + " " + o.obj.GetNamespace() + "/" + o.obj.GetName()
}

// kustomization is the part of kustomize's Kustomization that deploy/ uses.
// It is decoded strictly, so a field kustomize would act on and this
// test's build would not (namespace, images, a patch target) fails the
// test instead of being ignored.
type kustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Resources  []string `json:"resources,omitempty"`
	Patches    []struct {
		Path string `json:"path"`
	} `json:"patches,omitempty"`
}

// newTyped returns an empty object of the k8s.io/api type of apiVersion
// and kind: the kinds deploy/ may hold.
func newTyped(apiVersion, kind string) (metav1.Object, error) {
	switch apiVersion + " " + kind {
	case "v1 Namespace":
		return &corev1.Namespace{}, nil
	case "v1 ServiceAccount":
		return &corev1.ServiceAccount{}, nil
	case "rbac.authorization.k8s.io/v1 ClusterRole":
		return &rbacv1.ClusterRole{}, nil
	case "rbac.authorization.k8s.io/v1 ClusterRoleBinding":
		return &rbacv1.ClusterRoleBinding{}, nil
	case "rbac.authorization.k8s.io/v1 Role":
		return &rbacv1.Role{}, nil
	case "rbac.authorization.k8s.io/v1 RoleBinding":
		return &rbacv1.RoleBinding{}, nil
	case "apps/v1 DaemonSet":
		return &appsv1.DaemonSet{}, nil
	case "apps/v1 Deployment":
		return &appsv1.Deployment{}, nil
	case "apiextensions.k8s.io/v1 CustomResourceDefinition":
		return &apiextensionsv1.CustomResourceDefinition{}, nil
	}
	return nil, fmt.Errorf("kind %q of %q is not one deploy/ may hold", kind, apiVersion)
}

var docSeparator = regexp.MustCompile(`(?m)^---[ \t]*$`)

// decodeManifests decodes every YAML document of data strictly: a field
// its type does not have, or a field given twice, is an error.
func decodeManifests(file string, data []byte) ([]deployObject, error) {
	var objs []deployObject
	for i, doc := range docSeparator.Split(string(data), -1) {
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
			return nil, fmt.Errorf("%s, document %d: %w", file, i+1, err)
		}
		if tm.APIVersion == "" && tm.Kind == "" && strings.TrimSpace(stripComments(doc)) == "" {
			continue
		}
		obj, err := newTyped(tm.APIVersion, tm.Kind)
		if err != nil {
			return nil, fmt.Errorf("%s, document %d: %w", file, i+1, err)
		}
		if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
			return nil, fmt.Errorf("%s, document %d (%s): %w", file, i+1, tm.Kind, err)
		}
		objs = append(objs, deployObject{file: file, apiVersion: tm.APIVersion, kind: tm.Kind, obj: obj, doc: doc})
	}
	return objs, nil
}

func stripComments(doc string) string {
	var b strings.Builder
	for l := range strings.Lines(doc) {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			b.WriteString(l)
		}
	}
	return b.String()
}

// kustomizeBuild builds the kustomization in dir (relative to deploy/) as
// kustomize does for the fields kustomization has: the resources in order
// (directories built recursively), then each patch merged into its target
// as a strategic merge patch. used collects every file it read.
func kustomizeBuild(dir string, used map[string]bool) ([]deployObject, error) {
	kpath := path.Join(dir, "kustomization.yaml")
	data, err := os.ReadFile(filepath.Join(deployDir, kpath))
	if err != nil {
		return nil, err
	}
	used[kpath] = true
	var k kustomization
	if err := yaml.UnmarshalStrict(data, &k); err != nil {
		return nil, fmt.Errorf("%s: %w", kpath, err)
	}
	if k.APIVersion != "kustomize.config.k8s.io/v1beta1" || k.Kind != "Kustomization" {
		return nil, fmt.Errorf("%s: %s %s, want kustomize.config.k8s.io/v1beta1 Kustomization", kpath, k.APIVersion, k.Kind)
	}
	var objs []deployObject
	for _, r := range k.Resources {
		rel := path.Join(dir, r)
		fi, err := os.Stat(filepath.Join(deployDir, rel))
		if err != nil {
			return nil, fmt.Errorf("%s: resource %s: %w", kpath, r, err)
		}
		var more []deployObject
		if fi.IsDir() {
			more, err = kustomizeBuild(rel, used)
		} else {
			more, err = readManifests(rel, used)
		}
		if err != nil {
			return nil, err
		}
		objs = append(objs, more...)
	}
	seen := map[string]string{}
	for _, o := range objs {
		if prev, ok := seen[o.key()]; ok {
			return nil, fmt.Errorf("%s: %s is in both %s and %s", kpath, o.key(), prev, o.file)
		}
		seen[o.key()] = o.file
	}
	for _, p := range k.Patches {
		rel := path.Join(dir, p.Path)
		patches, err := readManifests(rel, used)
		if err != nil {
			return nil, err
		}
		for _, patch := range patches {
			i := slices.IndexFunc(objs, func(o deployObject) bool { return o.key() == patch.key() })
			if i < 0 {
				return nil, fmt.Errorf("%s: the patch of %s has no target in the resources", rel, patch.key())
			}
			if objs[i].obj, err = strategicMerge(objs[i], patch); err != nil {
				return nil, err
			}
		}
	}
	return objs, nil
}

func readManifests(rel string, used map[string]bool) ([]deployObject, error) {
	data, err := os.ReadFile(filepath.Join(deployDir, rel))
	if err != nil {
		return nil, err
	}
	used[rel] = true
	return decodeManifests(rel, data)
}

// strategicMerge merges patch (one document of a patch file, already
// decoded strictly) into target.
func strategicMerge(target, p deployObject) (metav1.Object, error) {
	rel := p.file
	data := []byte(p.doc)
	patch, err := yaml.YAMLToJSON(data)
	if err != nil {
		return nil, err
	}
	orig, err := json.Marshal(target.obj)
	if err != nil {
		return nil, err
	}
	schema, _ := newTyped(target.apiVersion, target.kind)
	merged, err := strategicpatch.StrategicMergePatch(orig, patch, schema)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", rel, err)
	}
	out, _ := newTyped(target.apiVersion, target.kind)
	dec := json.NewDecoder(bytes.NewReader(merged))
	dec.DisallowUnknownFields()
	if err := dec.Decode(out); err != nil {
		return nil, fmt.Errorf("%s merged into %s: %w", rel, target.file, err)
	}
	return out, nil
}

// deployRoots are the directories of deploy/ that hold a kustomization.
func deployRoots(t *testing.T) []string {
	t.Helper()
	var roots []string
	err := filepath.WalkDir(deployDir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Name() == "kustomization.yaml" {
			rel, _ := filepath.Rel(deployDir, filepath.Dir(p))
			roots = append(roots, filepath.ToSlash(rel))
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(roots)
	return roots
}

// buildDeploy builds root or fails the test.
func buildDeploy(t *testing.T, root string) []deployObject {
	t.Helper()
	objs, err := kustomizeBuild(root, map[string]bool{})
	if err != nil {
		t.Fatalf("deploy/%s: %v", root, err)
	}
	return objs
}

func findObject[T any](t *testing.T, objs []deployObject, kind string) []T {
	t.Helper()
	var out []T
	for _, o := range objs {
		if o.kind == kind {
			out = append(out, any(o.obj).(T))
		}
	}
	return out
}

// TestDeployManifestsStrict decodes every manifest of deploy/ strictly
// into its k8s.io/api type (an unknown or repeated field fails), builds
// every kustomization as `kubectl apply -k` would, and fails on a YAML
// file no kustomization reads. With kubectl on the PATH it also compares
// `kubectl kustomize` of every root with this test's build.
func TestDeployManifestsStrict(t *testing.T) {
	roots := deployRoots(t)
	for _, want := range []string{"base", "crds", "overlays/etcd", "overlays/operator"} {
		if !slices.Contains(roots, want) {
			t.Errorf("deploy/%s has no kustomization.yaml (roots: %v)", want, roots)
		}
	}
	used := map[string]bool{}
	built := map[string][]deployObject{}
	for _, root := range roots {
		objs, err := kustomizeBuild(root, used)
		if err != nil {
			t.Errorf("deploy/%s: %v", root, err)
			continue
		}
		if len(objs) == 0 {
			t.Errorf("deploy/%s builds no object", root)
		}
		built[root] = objs
	}
	err := filepath.WalkDir(deployDir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(deployDir, p)
		rel = filepath.ToSlash(rel)
		switch {
		case !strings.HasSuffix(rel, ".yaml") && !strings.HasSuffix(rel, ".yml"):
			t.Errorf("deploy/%s: only YAML manifests belong in deploy/", rel)
		case !used[rel]:
			t.Errorf("deploy/%s: no kustomization reads it", rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		t.Log("kubectl is not on the PATH: `kubectl kustomize` of deploy/ not compared with this test's build")
		return
	}
	for root, objs := range built {
		out, err := exec.Command(kubectl, "kustomize", filepath.Join(deployDir, root)).Output()
		if err != nil {
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				err = fmt.Errorf("%w: %s", err, ee.Stderr)
			}
			t.Errorf("kubectl kustomize deploy/%s: %v", root, err)
			continue
		}
		theirs, err := decodeManifests("kubectl kustomize deploy/"+root, out)
		if err != nil {
			t.Error(err)
			continue
		}
		if a, b := normalized(t, objs), normalized(t, theirs); a != b {
			t.Errorf("kubectl kustomize deploy/%s differs from this test's build:\n--- kubectl\n%s\n--- test\n%s", root, b, a)
		}
	}
}

// normalized renders objs in a canonical order for comparison: objects by
// key, and the lists a strategic merge may order differently (containers'
// variables and mounts, volumes) by name.
func normalized(t *testing.T, objs []deployObject) string {
	t.Helper()
	objs = slices.Clone(objs)
	sort.Slice(objs, func(i, j int) bool { return objs[i].key() < objs[j].key() })
	var b strings.Builder
	for _, o := range objs {
		obj := o.obj
		if ds, ok := obj.(*appsv1.DaemonSet); ok {
			ds = ds.DeepCopy()
			spec := &ds.Spec.Template.Spec
			slices.SortFunc(spec.Volumes, func(a, b corev1.Volume) int { return strings.Compare(a.Name, b.Name) })
			for i := range spec.Containers {
				c := &spec.Containers[i]
				slices.SortFunc(c.Env, func(a, b corev1.EnvVar) int { return strings.Compare(a.Name, b.Name) })
				slices.SortFunc(c.VolumeMounts, func(a, b corev1.VolumeMount) int { return strings.Compare(a.Name, b.Name) })
			}
			obj = ds
		}
		data, err := yaml.Marshal(obj)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&b, "# %s\n%s", o.key(), data)
	}
	return b.String()
}

// binaryFlags returns the flags `identityd --help` lists, as the binary
// prints them, and checks them against the command's flag set, whose
// definitions (defaults, types) the callers use.
func binaryFlags(t *testing.T) (all *pflag.FlagSet, hive map[string]bool) {
	t.Helper()
	out, err := run(t, "--help")
	if err != nil {
		t.Fatalf("identityd --help: %v\n%s", err, out)
	}
	listed := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^\s+(?:-\w, )?--([a-z0-9-]+)`).FindAllStringSubmatch(out, -1) {
		listed[m[1]] = true
	}
	root := newRootCmd(newHive(), &bytes.Buffer{}, &bytes.Buffer{})
	all = root.Flags()
	all.AddFlagSet(root.PersistentFlags())
	all.VisitAll(func(f *pflag.Flag) {
		if !listed[f.Name] {
			t.Errorf("identityd --help does not list --%s", f.Name)
		}
	})
	if len(listed) < 10 {
		t.Fatalf("identityd --help lists %d flags:\n%s", len(listed), out)
	}
	hive = map[string]bool{}
	hfs := pflag.NewFlagSet("hive", pflag.ContinueOnError)
	newHive().RegisterFlags(hfs)
	hfs.VisitAll(func(f *pflag.Flag) { hive[f.Name] = true })
	return all, hive
}

// agentSettings are the flags a container sets: from its args, literal
// values or from the environment (IDENTITYD_<FLAG>), the default otherwise.
type agentSettings struct {
	args    map[string]string // --name=value
	fromEnv map[string]corev1.EnvVar
	flags   *pflag.FlagSet
}

// value is the flag's value in the container: its arg, its variable's
// literal value, or its default; fromEnv is true when a variable sets it
// from elsewhere (the downward API, a ConfigMap).
func (s agentSettings) value(name string) (v string, fromEnv bool) {
	if v, ok := s.args[name]; ok {
		return v, false
	}
	if e, ok := s.fromEnv[name]; ok {
		return e.Value, e.ValueFrom != nil
	}
	return s.flags.Lookup(name).DefValue, false
}

func (s agentSettings) duration(t *testing.T, name string) time.Duration {
	t.Helper()
	v, _ := s.value(name)
	d, err := time.ParseDuration(v)
	if err != nil {
		t.Fatalf("--%s=%q: %v", name, v, err)
	}
	return d
}

// containerSettings checks the container's args and variables against the
// binary's flags and returns what they set.
func containerSettings(t *testing.T, c corev1.Container, flags *pflag.FlagSet, hiveFlags map[string]bool) agentSettings {
	t.Helper()
	s := agentSettings{args: map[string]string{}, fromEnv: map[string]corev1.EnvVar{}, flags: flags}
	if len(c.Command) > 0 {
		t.Errorf("container %s sets command %q: the image's entrypoint is the agent", c.Name, c.Command)
	}
	for _, a := range c.Args {
		name, val, ok := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !strings.HasPrefix(a, "--") || !ok {
			t.Errorf("arg %q: want --flag=value, one arg per flag", a)
			continue
		}
		if flags.Lookup(name) == nil {
			t.Errorf("arg %q: identityd --help has no --%s", a, name)
			continue
		}
		if _, dup := s.args[name]; dup {
			t.Errorf("arg --%s given twice", name)
		}
		s.args[name] = val
	}
	for _, e := range c.Env {
		if runtimeEnv[e.Name] {
			continue
		}
		name, ok := strings.CutPrefix(e.Name, EnvPrefix)
		if !ok {
			t.Errorf("variable %s: identityd reads only %s<FLAG> (and the Go runtime %v)", e.Name, EnvPrefix, slices.Sorted(func(yield func(string) bool) {
				for k := range runtimeEnv {
					if !yield(k) {
						return
					}
				}
			}))
			continue
		}
		flag := strings.ReplaceAll(strings.ToLower(name), "_", "-")
		switch {
		case flags.Lookup(flag) == nil:
			t.Errorf("variable %s: identityd --help has no --%s", e.Name, flag)
		case !hiveFlags[flag]:
			t.Errorf("variable %s: --%s is not one of the hive's flags, which alone are read from the environment", e.Name, flag)
		case hasKey(s.args, flag):
			t.Errorf("variable %s and arg --%s both set the flag; the arg wins", e.Name, flag)
		}
		s.fromEnv[flag] = e
	}
	return s
}

// TestDeployDaemonSet checks the DaemonSet of every root of deploy/
// against the binary: its args are flags of `identityd --help` whose values
// the agent accepts (`identityd hive` with them), its variables name flags
// of the hive, the probes ask /healthz and /readyz on the address of
// --prometheus-serve-addr, the state directory and the pin path are on the
// host (the pin's directory alone of the host's bpffs), AppArmor, SELinux
// and seccomp leave bpf(2) and the bpffs to the agent, the grace period
// covers the stop, and a rolling update never runs
// two agents on a node. The base runs in crd mode as its ServiceAccount,
// bound to the ClusterRole; the etcd overlay in kvstore mode with the TLS
// files of a mounted secret.
func TestDeployDaemonSet(t *testing.T) {
	parallelProcess(t)
	flags, hiveFlags := binaryFlags(t)
	for _, root := range workloadRoots {
		t.Run(strings.ReplaceAll(root, "/", "-"), func(t *testing.T) {
			objs := buildDeploy(t, root)
			dss := findObject[*appsv1.DaemonSet](t, objs, "DaemonSet")
			if len(dss) != 1 {
				t.Fatalf("deploy/%s has %d DaemonSets, want 1", root, len(dss))
			}
			ds := dss[0]
			spec := ds.Spec.Template.Spec
			if len(spec.Containers) != 1 {
				t.Fatalf("%d containers, want the agent alone", len(spec.Containers))
			}
			c := spec.Containers[0]
			s := containerSettings(t, c, flags, hiveFlags)
			checkAgentAcceptsSettings(t, c)

			// The node name comes from the pod's node, and from nowhere else.
			nn, ok := s.fromEnv["node-name"]
			if !ok || nn.Name != "IDENTITYD_NODE_NAME" || nn.ValueFrom == nil || nn.ValueFrom.FieldRef == nil || nn.ValueFrom.FieldRef.FieldPath != "spec.nodeName" {
				t.Errorf("IDENTITYD_NODE_NAME is not taken from spec.nodeName: %+v", nn)
			}

			// On Kubernetes the identity manager collects, and the
			// agents' role has no delete (TestDeployManager).
			if gc := s.duration(t, "identity-gc-interval"); gc != 0 {
				t.Errorf("--identity-gc-interval=%v: the agents must not collect, the identity manager does", gc)
			}
			mode, _ := s.value("identity-allocation-mode")
			management, _ := s.value("identity-management-mode")
			if want := map[string]string{"overlays/operator": "operator"}[root]; management != cmp.Or(want, "agent") {
				t.Errorf("--identity-management-mode=%s, want %s", management, cmp.Or(want, "agent"))
			}
			switch root {
			case "base", "overlays/operator":
				if mode != "crd" {
					t.Errorf("--identity-allocation-mode=%s, want crd", mode)
				}
			case "overlays/etcd":
				if mode != "kvstore" {
					t.Errorf("--identity-allocation-mode=%s, want kvstore", mode)
				}
				// Without a Kubernetes client a kvstore agent reads no
				// pod, and gives no workload an identity.
				if api, _ := s.value("k8s-api-server"); !strings.HasPrefix(api, "https://") {
					t.Errorf("--k8s-api-server=%q: a kvstore agent needs the API server for its pods", api)
				}
				checkEtcdTLS(t, s, spec, c)
			}

			checkProbes(t, s, spec, c)
			checkHostPaths(t, s, spec, c)
			checkConfinement(t, ds.Spec.Template, c)

			// The grace period covers hive's stop timeout, within which the
			// final checkpoint is written, with room for the exit.
			if g := spec.TerminationGracePeriodSeconds; g == nil || time.Duration(*g)*time.Second < agentOptions().StopTimeout+10*time.Second {
				t.Errorf("terminationGracePeriodSeconds %v, want at least the stop timeout %v and 10s", derefInt64(g), agentOptions().StopTimeout)
			}
			us := ds.Spec.UpdateStrategy
			switch {
			case us.Type != appsv1.RollingUpdateDaemonSetStrategyType || us.RollingUpdate == nil || us.RollingUpdate.MaxUnavailable == nil:
				t.Errorf("updateStrategy %+v: want RollingUpdate with maxUnavailable", us)
			case us.RollingUpdate.MaxSurge != nil && us.RollingUpdate.MaxSurge.String() != "0":
				t.Errorf("maxSurge %s: two agents on one node share the state directory and the pin, the second cannot start", us.RollingUpdate.MaxSurge)
			case us.RollingUpdate.MaxUnavailable.String() == "0" || us.RollingUpdate.MaxUnavailable.String() == "0%":
				t.Errorf("maxUnavailable %s: the update could never start", us.RollingUpdate.MaxUnavailable)
			}

			req, lim := c.Resources.Requests, c.Resources.Limits
			if req.Cpu().IsZero() || req.Memory().IsZero() {
				t.Errorf("resource requests %v: want cpu and memory", req)
			}
			if m, ok := lim[corev1.ResourceMemory]; ok && m.Cmp(*req.Memory()) < 0 {
				t.Errorf("memory limit %s below the request %s", m.String(), req.Memory())
			}

			checkServiceAccount(t, objs, ds.Namespace, spec.ServiceAccountName)

			if ds.Spec.Selector == nil || !labelsMatch(ds.Spec.Selector.MatchLabels, ds.Spec.Template.Labels) {
				t.Errorf("the selector %v does not select the pod template's labels %v", ds.Spec.Selector, ds.Spec.Template.Labels)
			}
			if sc := c.SecurityContext; sc == nil || sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") {
				t.Errorf("the container does not drop every capability it does not add: %+v", c.SecurityContext)
			}
		})
	}
}

func derefInt64(p *int64) any {
	if p == nil {
		return nil
	}
	return *p
}

func labelsMatch(sel, labels map[string]string) bool {
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return len(sel) > 0
}

// checkAgentAcceptsSettings runs `identityd hive` with the container's args
// and variables (the ones set from elsewhere given a sample value), which
// parses every flag and builds the agent's cells without starting them.
func checkAgentAcceptsSettings(t *testing.T, c corev1.Container) {
	t.Helper()
	env := []string{}
	for _, e := range c.Env {
		v := e.Value
		switch {
		case e.ValueFrom == nil:
		case e.Name == "GOMEMLIMIT":
			v = "536870912"
		case strings.HasSuffix(e.Name, "_ENDPOINTS"):
			v = "https://127.0.0.1:2379"
		default:
			v = "node-a"
		}
		env = append(env, e.Name+"="+v)
	}
	cmd := agentCmd(t, append([]string{"hive"}, c.Args...)...)
	cmd.Env = append(cmd.Env, env...)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "Start hooks:") {
		t.Errorf("identityd hive %s (with %v): %v\n%.2000s", strings.Join(c.Args, " "), env, err, out)
	}
}

// checkProbes: liveness (and startup) on /healthz, readiness on /readyz, at
// the address --prometheus-serve-addr serves; the startup probe's window
// covers the start's wait for the first listing of global identities.
func checkProbes(t *testing.T, s agentSettings, spec corev1.PodSpec, c corev1.Container) {
	t.Helper()
	addr, _ := s.value("prometheus-serve-addr")
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("--prometheus-serve-addr=%q: %v", addr, err)
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() && !spec.HostNetwork {
		t.Errorf("--prometheus-serve-addr=%s is loopback, which the kubelet reaches only with hostNetwork", addr)
	}
	for _, p := range []struct {
		name  string
		probe *corev1.Probe
		path  string
	}{
		{"startupProbe", c.StartupProbe, "/healthz"},
		{"livenessProbe", c.LivenessProbe, "/healthz"},
		{"readinessProbe", c.ReadinessProbe, "/readyz"},
	} {
		if p.probe == nil || p.probe.HTTPGet == nil {
			t.Errorf("%s: want an httpGet of %s", p.name, p.path)
			continue
		}
		g := p.probe.HTTPGet
		if g.Path != p.path {
			t.Errorf("%s asks %s, want %s", p.name, g.Path, p.path)
		}
		if g.Port.String() != port || (g.Host != host && !(g.Host == "" && (host == "" || host == "0.0.0.0" || host == "::"))) {
			t.Errorf("%s asks %s:%s, the agent serves at %s (--prometheus-serve-addr)", p.name, g.Host, g.Port.String(), addr)
		}
		if g.Scheme != "" && g.Scheme != corev1.URISchemeHTTP {
			t.Errorf("%s: scheme %s, the agent serves HTTP", p.name, g.Scheme)
		}
	}
	if sp := c.StartupProbe; sp != nil {
		window := time.Duration(max(sp.PeriodSeconds, 1)*max(sp.FailureThreshold, 1)) * time.Second
		if list := s.duration(t, "allocator-list-timeout"); window < list {
			t.Errorf("the startup probe gives the start %v, less than --allocator-list-timeout %v", window, list)
		}
	}
}

// mountOf returns the volume mounted at the longest mount path that holds
// dir, and that mount.
func mountOf(spec corev1.PodSpec, c corev1.Container, dir string) (*corev1.Volume, *corev1.VolumeMount) {
	var best *corev1.VolumeMount
	for i, m := range c.VolumeMounts {
		mp := path.Clean(m.MountPath)
		if (dir == mp || strings.HasPrefix(dir, mp+"/")) && (best == nil || len(mp) > len(best.MountPath)) {
			best = &c.VolumeMounts[i]
		}
	}
	if best == nil {
		return nil, nil
	}
	for i, v := range spec.Volumes {
		if v.Name == best.Name {
			return &spec.Volumes[i], best
		}
	}
	return nil, best
}

// checkHostPaths: the state directory is a host directory of its own,
// created when missing, and the ipcache map's pin is on the host's bpffs.
func checkHostPaths(t *testing.T, s agentSettings, spec corev1.PodSpec, c corev1.Container) {
	t.Helper()
	dir, _ := s.value("state-dir")
	v, m := mountOf(spec, c, dir)
	switch {
	case v == nil || v.HostPath == nil:
		t.Errorf("--state-dir=%s is not on a hostPath volume: the checkpoint would not outlive the pod", dir)
	case path.Clean(m.MountPath) != path.Clean(dir):
		t.Errorf("--state-dir=%s is below the mount %s: the agent's 0700 and owner check apply to the state directory itself", dir, m.MountPath)
	case v.HostPath.Type == nil || *v.HostPath.Type != corev1.HostPathDirectoryOrCreate:
		t.Errorf("the state directory's hostPath %s: want type DirectoryOrCreate", v.HostPath.Path)
	case m.ReadOnly:
		t.Errorf("the state directory is mounted read-only")
	}

	if mapKind, _ := s.value("ipcache-map"); mapKind == "file" {
		return
	}
	pin, _ := s.value("ipcache-map-pin-path")
	pinDir := path.Dir(pin)
	v, m = mountOf(spec, c, pinDir)
	switch {
	case v == nil || v.HostPath == nil || !strings.HasPrefix(path.Clean(v.HostPath.Path)+"/", hostBPFFS+"/"):
		t.Errorf("--ipcache-map-pin-path=%s is not on the host's bpffs (a hostPath under %s): the map would not outlive the pod", pin, hostBPFFS)
	case path.Clean(v.HostPath.Path) != pinDir || path.Clean(m.MountPath) != pinDir:
		t.Errorf("the pin's directory is the host's %s mounted at %s: mount the pin's own directory %s at the same path, so that the pin has one name on the node and in the pod", v.HostPath.Path, m.MountPath, pinDir)
	case v.HostPath.Type == nil || *v.HostPath.Type != corev1.HostPathDirectoryOrCreate:
		t.Errorf("the pin's hostPath %s: want type DirectoryOrCreate (the kubelet makes identityd's directory on the bpffs)", v.HostPath.Path)
	case m.ReadOnly:
		t.Errorf("the pin's directory is mounted read-only")
	}
	for _, vol := range spec.Volumes {
		if hp := vol.HostPath; hp != nil && strings.HasPrefix(hostBPFFS+"/", strings.TrimSuffix(path.Clean(hp.Path), "/")+"/") {
			t.Errorf("volume %s mounts the host's %s, the whole bpffs: the container could open every map pinned on the node, Cilium's included; mount identityd's own directory %s", vol.Name, hp.Path, pinDir)
		}
	}
}

// hostBPFFS is where hosts mount their bpffs, Cilium's maps included.
const hostBPFFS = "/sys/fs/bpf"

// checkConfinement: the agent runs unconfined by AppArmor and as spc_t
// under SELinux, as Cilium's agent does, since it pins on the host's
// bpffs, and without a seccomp filter.
func checkConfinement(t *testing.T, tmpl corev1.PodTemplateSpec, c corev1.Container) {
	t.Helper()
	key := corev1.DeprecatedAppArmorBetaContainerAnnotationKeyPrefix + c.Name
	if got := tmpl.Annotations[key]; got != corev1.DeprecatedAppArmorBetaProfileNameUnconfined {
		t.Errorf("pod template annotation %s=%q, want %q", key, got, corev1.DeprecatedAppArmorBetaProfileNameUnconfined)
	}
	sc := c.SecurityContext
	if sc == nil || sc.SELinuxOptions == nil || sc.SELinuxOptions.Type != "spc_t" {
		var opts *corev1.SELinuxOptions
		if sc != nil {
			opts = sc.SELinuxOptions
		}
		t.Errorf("the container's seLinuxOptions %+v: want type spc_t", opts)
	}
	if sc == nil || sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeUnconfined {
		t.Errorf("the container's seccompProfile: want Unconfined (runtimes' default profiles may allow bpf(2) only with CAP_SYS_ADMIN)")
	}
}

// checkEtcdTLS: the overlay reaches external etcd with the certificate and
// key of a secret mounted read-only, the endpoints set.
func checkEtcdTLS(t *testing.T, s agentSettings, spec corev1.PodSpec, c corev1.Container) {
	t.Helper()
	if ep, fromEnv := s.value("kvstore-endpoints"); ep == "" && !fromEnv {
		t.Errorf("--kvstore-endpoints is not set: the agent would run an embedded etcd")
	}
	for _, f := range []string{"kvstore-ca-file", "kvstore-cert-file", "kvstore-key-file"} {
		file, _ := s.value(f)
		if file == "" {
			t.Errorf("--%s is not set", f)
			continue
		}
		v, m := mountOf(spec, c, path.Dir(file))
		if v == nil || v.Secret == nil || !m.ReadOnly {
			t.Errorf("--%s=%s is not in a secret mounted read-only", f, file)
			continue
		}
		// The files are root's; a pod of another user reads them as
		// the group of its fsGroup, which only its own processes have.
		others := int32(0o077)
		if psc := spec.SecurityContext; psc != nil && psc.FSGroup != nil && psc.RunAsUser != nil && *psc.RunAsUser != 0 {
			others = 0o007
		}
		if dm := v.Secret.DefaultMode; dm == nil || *dm&others != 0 {
			t.Errorf("secret %s: defaultMode %s lets others than the pod's user read the key", v.Secret.SecretName, fileMode(dm))
		}
	}
}

// checkServiceAccount: the pods run as the ServiceAccount sa of the
// build, which a binding of the build gives a ClusterRole of the build.
func checkServiceAccount(t *testing.T, objs []deployObject, ns, sa string) {
	t.Helper()
	if !slices.ContainsFunc(findObject[*corev1.ServiceAccount](t, objs, "ServiceAccount"), func(o *corev1.ServiceAccount) bool {
		return o.Name == sa && o.Namespace == ns
	}) {
		t.Errorf("serviceAccountName %q: no such ServiceAccount in namespace %s", sa, ns)
	}
	if !slices.ContainsFunc(findObject[*corev1.Namespace](t, objs, "Namespace"), func(o *corev1.Namespace) bool { return o.Name == ns }) {
		t.Errorf("namespace %s is not created by the build", ns)
	}
	roles := findObject[*rbacv1.ClusterRole](t, objs, "ClusterRole")
	if !slices.ContainsFunc(findObject[*rbacv1.ClusterRoleBinding](t, objs, "ClusterRoleBinding"), func(b *rbacv1.ClusterRoleBinding) bool {
		return b.RoleRef.Kind == "ClusterRole" && b.RoleRef.APIGroup == rbacv1.GroupName &&
			slices.ContainsFunc(roles, func(r *rbacv1.ClusterRole) bool { return r.Name == b.RoleRef.Name }) &&
			slices.Contains(b.Subjects, rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Name: sa, Namespace: ns})
	}) {
		t.Errorf("no ClusterRoleBinding of the build binds a ClusterRole of the build to ServiceAccount %s/%s", ns, sa)
	}
}

// workloadRoots are the builds of deploy/ that run identityd: the agents'
// DaemonSet and the identity manager's Deployment.
var workloadRoots = []string{"base", "overlays/etcd", "overlays/operator"}

// TestDeployManager checks the identity manager's Deployment of every
// build against the binary and the build's DaemonSet: its args are
// `identityd manager` and flags the manager has, it runs at least two
// replicas, collects (a positive --identity-gc-interval, which the agents
// leave to it) in the agents' allocation and management modes, names its
// record after its pod, keeps its Leases in its own namespace (where the
// build's Role grants them), keeps its state in the pod (the kubelet
// probes the pod's address, where the manager serves its health), and
// runs as a user other than root with no capability; the agents' roles
// grant no delete of CiliumIdentity objects.
func TestDeployManager(t *testing.T) {
	parallelProcess(t)
	root := newRootCmd(newHive(), &bytes.Buffer{}, &bytes.Buffer{})
	mcmd, _, err := root.Find([]string{"manager"})
	if err != nil || mcmd == root {
		t.Fatalf("identityd has no manager command: %v", err)
	}
	hiveFlags := map[string]bool{}
	mcmd.Flags().VisitAll(func(f *pflag.Flag) { hiveFlags[f.Name] = true })
	mflags := pflag.NewFlagSet("manager", pflag.ContinueOnError)
	mflags.AddFlagSet(mcmd.Flags())
	mflags.AddFlagSet(root.PersistentFlags())
	agentFlags, agentHive := binaryFlags(t)
	for _, root := range workloadRoots {
		t.Run(strings.ReplaceAll(root, "/", "-"), func(t *testing.T) {
			objs := buildDeploy(t, root)
			deps := findObject[*appsv1.Deployment](t, objs, "Deployment")
			if len(deps) != 1 {
				t.Fatalf("deploy/%s has %d Deployments, want the identity manager's", root, len(deps))
			}
			d := deps[0]
			spec := d.Spec.Template.Spec
			if d.Spec.Replicas == nil || *d.Spec.Replicas < 2 {
				t.Errorf("replicas %v: want at least 2, so that one takes over when the other goes", derefInt32(d.Spec.Replicas))
			}
			if len(spec.Containers) != 1 {
				t.Fatalf("%d containers, want the manager alone", len(spec.Containers))
			}
			c := spec.Containers[0]
			if len(c.Args) == 0 || c.Args[0] != "manager" {
				t.Fatalf("args %q: want the subcommand manager first", c.Args)
			}
			mc := c.DeepCopy()
			mc.Args = mc.Args[1:]
			s := containerSettings(t, *mc, mflags, hiveFlags)
			checkProbes(t, s, spec, c)
			checkServiceAccount(t, objs, d.Namespace, spec.ServiceAccountName)
			if !labelsMatch(d.Spec.Selector.MatchLabels, d.Spec.Template.Labels) {
				t.Errorf("the selector %v does not select the pod template's labels %v", d.Spec.Selector, d.Spec.Template.Labels)
			}

			nn, ok := s.fromEnv["node-name"]
			if !ok || nn.ValueFrom == nil || nn.ValueFrom.FieldRef == nil || nn.ValueFrom.FieldRef.FieldPath != "metadata.name" {
				t.Errorf("IDENTITYD_NODE_NAME is not taken from metadata.name (one record per replica): %+v", nn)
			}
			if gc := s.duration(t, "identity-gc-interval"); gc <= 0 {
				t.Errorf("--identity-gc-interval=%v: the manager is where the collection runs", gc)
			}
			for _, lease := range []string{"identity-manager-lease-namespace", "identity-gc-lease-namespace"} {
				if ns, _ := s.value(lease); ns != d.Namespace && (ns != "" || lease != "identity-gc-lease-namespace") {
					t.Errorf("--%s=%q: want the manager's namespace %s, where the Role grants the Leases", lease, ns, d.Namespace)
				}
			}
			ds := findObject[*appsv1.DaemonSet](t, objs, "DaemonSet")[0]
			as := containerSettings(t, ds.Spec.Template.Spec.Containers[0], agentFlags, agentHive)
			for _, f := range []string{"identity-allocation-mode", "identity-management-mode"} {
				if m, a := first(s.value(f)), first(as.value(f)); m != a {
					t.Errorf("--%s=%s in the manager, %s in the agents", f, m, a)
				}
			}

			dir, _ := s.value("state-dir")
			if v, _ := mountOf(spec, c, dir); v == nil || v.EmptyDir == nil {
				t.Errorf("--state-dir=%s is not in an emptyDir of the pod", dir)
			}
			psc, sc := spec.SecurityContext, c.SecurityContext
			if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil || *psc.RunAsUser == 0 {
				t.Errorf("pod securityContext %+v: want runAsNonRoot and a user other than root", psc)
			}
			if sc == nil || sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") || len(sc.Capabilities.Add) > 0 ||
				sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
				t.Errorf("container securityContext %+v: want every capability dropped, none added, a read-only root and no privilege escalation", sc)
			}
			if spec.HostNetwork {
				t.Error("hostNetwork: the manager needs no node's network")
			}
			if g := spec.TerminationGracePeriodSeconds; g == nil || time.Duration(*g)*time.Second < agentOptions().StopTimeout+10*time.Second {
				t.Errorf("terminationGracePeriodSeconds %v, want at least the stop timeout %v and 10s", derefInt64(g), agentOptions().StopTimeout)
			}
			if root == "overlays/etcd" {
				checkEtcdTLS(t, s, spec, c)
			}
			// Cilium's agents delete no identity, its operator does:
			// neither do identityd's, in any build.
			agent := deployAccounts(t, root)["agent"]
			for _, v := range []string{"delete", "deletecollection", "*"} {
				if agent.grants()[apiRequest{Group: "cilium.io", Resource: "ciliumidentities", Verb: v}] {
					t.Errorf("the agents' roles grant %s on ciliumidentities", v)
				}
			}
		})
	}
}

func first[T any](v T, _ ...any) T { return v }

func derefInt32(p *int32) any {
	if p == nil {
		return nil
	}
	return *p
}

// TestDeployCRDs: deploy/crds holds exactly the CRDs the binary registers
// (crdstore.CRDs), field for field. -update-deploy rewrites it.
func TestDeployCRDs(t *testing.T) {
	want := crdstore.CRDs()
	if *updateDeploy {
		writeDeployCRDs(t, want)
	}
	got := findObject[*apiextensionsv1.CustomResourceDefinition](t, buildDeploy(t, "crds"), "CustomResourceDefinition")
	byName := map[string]*apiextensionsv1.CustomResourceDefinition{}
	for _, c := range got {
		byName[c.Name] = c
	}
	for _, w := range want {
		g, ok := byName[w.Name]
		if !ok {
			t.Errorf("deploy/crds lacks %s, which the agent registers", w.Name)
			continue
		}
		delete(byName, w.Name)
		g = g.DeepCopy()
		g.TypeMeta = metav1.TypeMeta{} // the agent's objects leave it to the client
		if !apiequality.Semantic.DeepEqual(g, w) {
			gy, _ := yaml.Marshal(g)
			wy, _ := yaml.Marshal(w)
			t.Errorf("deploy/crds' %s differs from the one the agent registers; run\n  go test ./cmd/identityd -run TestDeployCRDs -update-deploy\ndeploy/crds:\n%s\nthe agent's:\n%s", w.Name, gy, wy)
		}
	}
	for name := range byName {
		t.Errorf("deploy/crds holds %s, which the agent does not register", name)
	}
	// The base leaves the CRDs out: deleting it must not delete them.
	for _, o := range buildDeploy(t, "base") {
		if o.kind == "CustomResourceDefinition" {
			t.Errorf("deploy/base holds CRD %s: `kubectl delete -k deploy/base` would delete every object of it", o.obj.GetName())
		}
	}
}

// writeDeployCRDs writes one file per CRD into deploy/crds, and its
// kustomization.
func writeDeployCRDs(t *testing.T, crds []*apiextensionsv1.CustomResourceDefinition) {
	t.Helper()
	dir := filepath.Join(deployDir, "crds")
	old, _ := filepath.Glob(filepath.Join(dir, "*.yaml"))
	for _, f := range old {
		os.Remove(f)
	}
	const header = "# Generated from cells/allocator/crdstore (go test ./cmd/identityd -run TestDeployCRDs -update-deploy).\n"
	kust := "# The CRDs the agents need, which an administrator installs before\n" +
		"# deploy/base: the agents' ClusterRole only reads CRDs. Never delete\n" +
		"# ciliumidentities.cilium.io while Cilium uses it: every CiliumIdentity\n" +
		"# goes with it.\n" + header +
		"apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n"
	for _, c := range crds {
		c = c.DeepCopy()
		c.APIVersion, c.Kind = "apiextensions.k8s.io/v1", "CustomResourceDefinition"
		data, err := yaml.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		// The zero status and creation time are the server's to fill.
		var m map[string]any
		if err := yaml.Unmarshal(data, &m); err != nil {
			t.Fatal(err)
		}
		delete(m, "status")
		delete(m["metadata"].(map[string]any), "creationTimestamp")
		if data, err = yaml.Marshal(m); err != nil {
			t.Fatal(err)
		}
		name := c.Name + ".yaml"
		if err := os.WriteFile(filepath.Join(dir, name), append([]byte(header), data...), 0o644); err != nil {
			t.Fatal(err)
		}
		kust += "  - " + name + "\n"
	}
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(kust), 0o644); err != nil {
		t.Fatal(err)
	}
}

// deployAccount is a ServiceAccount a workload of a deploy/ build runs
// as, with what the build's bindings grant it.
type deployAccount struct {
	// user is what the account authenticates as.
	user string
	// roles are the ClusterRoles bound to it, and its Roles as
	// ClusterRoles of the same rules (each grants them in its namespace).
	roles []rbacv1.ClusterRole
	// kubeconfig authenticates as the account, once applyDeployRBAC
	// applied the build's roles to an API server.
	kubeconfig string
}

// namespace is the account's namespace.
func (a deployAccount) namespace() string {
	ns, _, _ := strings.Cut(strings.TrimPrefix(a.user, "system:serviceaccount:"), ":")
	return ns
}

// grants returns the (group, resource, verb) triples of the account's
// roles.
func (a deployAccount) grants() map[apiRequest]bool {
	granted := map[apiRequest]bool{}
	for _, role := range a.roles {
		for _, r := range role.Rules {
			for _, g := range r.APIGroups {
				for _, res := range r.Resources {
					for _, v := range r.Verbs {
						granted[apiRequest{Group: g, Resource: res, Verb: v}] = true
					}
				}
			}
		}
	}
	return granted
}

// deployAccounts returns the accounts of deploy/<root>'s workloads: "agent"
// (the DaemonSet's) and "manager" (the identity manager's Deployment's).
func deployAccounts(t *testing.T, root string) map[string]deployAccount {
	t.Helper()
	objs := buildDeploy(t, root)
	clusterRoles := map[string]rbacv1.ClusterRole{}
	for _, r := range findObject[*rbacv1.ClusterRole](t, objs, "ClusterRole") {
		clusterRoles[r.Name] = *r
	}
	roles := map[string]rbacv1.ClusterRole{}
	for _, r := range findObject[*rbacv1.Role](t, objs, "Role") {
		roles[r.Namespace+"/"+r.Name] = rbacv1.ClusterRole{ObjectMeta: r.ObjectMeta, Rules: r.Rules}
	}
	account := func(kind string, ns string, spec corev1.PodSpec) deployAccount {
		if spec.ServiceAccountName == "" {
			t.Fatalf("deploy/%s: the %s sets no serviceAccountName", root, kind)
		}
		subject := rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Name: spec.ServiceAccountName, Namespace: ns}
		a := deployAccount{user: "system:serviceaccount:" + ns + ":" + spec.ServiceAccountName}
		for _, b := range findObject[*rbacv1.ClusterRoleBinding](t, objs, "ClusterRoleBinding") {
			if r, ok := clusterRoles[b.RoleRef.Name]; ok && b.RoleRef.Kind == "ClusterRole" && slices.Contains(b.Subjects, subject) {
				a.roles = append(a.roles, r)
			}
		}
		for _, b := range findObject[*rbacv1.RoleBinding](t, objs, "RoleBinding") {
			if r, ok := roles[b.Namespace+"/"+b.RoleRef.Name]; ok && b.RoleRef.Kind == "Role" && slices.Contains(b.Subjects, subject) {
				a.roles = append(a.roles, r)
			}
		}
		return a
	}
	dss := findObject[*appsv1.DaemonSet](t, objs, "DaemonSet")
	deps := findObject[*appsv1.Deployment](t, objs, "Deployment")
	if len(dss) != 1 || len(deps) != 1 {
		t.Fatalf("deploy/%s: %d DaemonSets and %d Deployments, want the agents' and the identity manager's", root, len(dss), len(deps))
	}
	return map[string]deployAccount{
		"agent":   account("DaemonSet", dss[0].Namespace, dss[0].Spec.Template.Spec),
		"manager": account("Deployment", deps[0].Namespace, deps[0].Spec.Template.Spec),
	}
}

func fileMode(m *int32) string {
	if m == nil {
		return "unset (0644)"
	}
	return fmt.Sprintf("%#o", *m)
}

func hasKey[V any](m map[string]V, k string) bool {
	_, ok := m[k]
	return ok
}

// ciliumPorts are the TCP ports Cilium's Helm chart has its components
// listen on by default, on the node's network (the agent, the operator
// and Envoy run with hostNetwork) or on ports of Cilium's that operators
// open on every node. An agent of identityd beside Cilium must listen on
// none of them, or one of the two fails to start on some node: the pod
// crash-loops with "address already in use" and the rollout stalls.
// From Cilium's "System Requirements" list of ports and its chart's values.
var ciliumPorts = map[int]string{
	2379: "etcd (kvstore mode, clustermesh-apiserver)",
	2380: "etcd peers",
	4240: "cilium-health, cluster health checks",
	4244: "Hubble server (Hubble peer)",
	4245: "Hubble Relay",
	4250: "mutual authentication",
	4251: "Spire agent health",
	6060: "cilium-agent pprof",
	6061: "cilium-operator pprof",
	6062: "Hubble Relay pprof",
	6063: "clustermesh-apiserver pprof",
	9234: "cilium-operator health API",
	9876: "cilium-agent health",
	9878: "cilium-envoy health",
	9879: "cilium-agent health API",
	9880: "clustermesh-apiserver health",
	9881: "KVStoreMesh health",
	9890: "cilium-agent gops",
	9891: "cilium-operator gops",
	9892: "clustermesh-apiserver gops",
	9893: "Hubble Relay gops",
	9901: "cilium-envoy admin API",
	9962: "cilium-agent Prometheus metrics",
	9963: "cilium-operator Prometheus metrics",
	9964: "cilium-envoy Prometheus metrics",
	9965: "Hubble metrics",
	9966: "Hubble Relay metrics",
}

// hostPorts returns the TCP ports the agent of the pod spec listens on in
// the node's network namespace, each with what names it: with
// hostNetwork, the port of --prometheus-serve-addr, the probes' ports and
// the container's ports; without, the container's host ports.
func hostPorts(t *testing.T, s agentSettings, spec corev1.PodSpec, c corev1.Container) map[int][]string {
	t.Helper()
	ports := map[int][]string{}
	for _, p := range c.Ports {
		if p.Protocol != "" && p.Protocol != corev1.ProtocolTCP {
			continue
		}
		if p.HostPort != 0 {
			ports[int(p.HostPort)] = append(ports[int(p.HostPort)], "hostPort of containerPort "+p.Name)
		}
		if spec.HostNetwork {
			ports[int(p.ContainerPort)] = append(ports[int(p.ContainerPort)], "containerPort "+p.Name)
		}
	}
	if !spec.HostNetwork {
		return ports
	}
	if addr, _ := s.value("prometheus-serve-addr"); addr != "" {
		_, port, err := net.SplitHostPort(addr)
		if err != nil {
			t.Fatalf("--prometheus-serve-addr=%q: %v", addr, err)
		}
		if n, err := strconv.Atoi(port); err == nil && n != 0 {
			ports[n] = append(ports[n], "--prometheus-serve-addr="+addr)
		}
	}
	for _, p := range []struct {
		name  string
		probe *corev1.Probe
	}{{"startupProbe", c.StartupProbe}, {"livenessProbe", c.LivenessProbe}, {"readinessProbe", c.ReadinessProbe}} {
		if p.probe != nil && p.probe.HTTPGet != nil && p.probe.HTTPGet.Port.IntValue() != 0 {
			n := p.probe.HTTPGet.Port.IntValue()
			ports[n] = append(ports[n], p.name)
		}
	}
	return ports
}

// TestDeployPortsNotCilium renders the DaemonSet of every root of deploy/
// and refuses any port it listens on in the node's network that Cilium's
// chart uses by default (ciliumPorts), and the same of the flag's default
// for an agent run on a node beside Cilium without --prometheus-serve-addr.
func TestDeployPortsNotCilium(t *testing.T) {
	root := newRootCmd(newHive(), &bytes.Buffer{}, &bytes.Buffer{})
	flags := root.Flags()
	flags.AddFlagSet(root.PersistentFlags())
	hiveFlags := map[string]bool{}
	hfs := pflag.NewFlagSet("hive", pflag.ContinueOnError)
	newHive().RegisterFlags(hfs)
	hfs.VisitAll(func(f *pflag.Flag) { hiveFlags[f.Name] = true })

	def := flags.Lookup("prometheus-serve-addr").DefValue
	_, port, err := net.SplitHostPort(def)
	if err != nil {
		t.Fatalf("--prometheus-serve-addr's default %q: %v", def, err)
	}
	if n, _ := strconv.Atoi(port); ciliumPorts[n] != "" {
		t.Errorf("--prometheus-serve-addr's default %s is the port of Cilium's %s", def, ciliumPorts[n])
	}

	checked := 0
	for _, r := range deployRoots(t) {
		for _, ds := range findObject[*appsv1.DaemonSet](t, buildDeploy(t, r), "DaemonSet") {
			spec := ds.Spec.Template.Spec
			for _, c := range spec.Containers {
				s := containerSettings(t, c, flags, hiveFlags)
				ports := hostPorts(t, s, spec, c)
				if spec.HostNetwork && len(ports) == 0 {
					t.Errorf("deploy/%s, container %s: on the host network with no port found", r, c.Name)
				}
				for p, what := range ports {
					checked++
					if cilium, ok := ciliumPorts[p]; ok {
						t.Errorf("deploy/%s, container %s: port %d of the node (%s) is Cilium's %s", r, c.Name, p, strings.Join(what, ", "), cilium)
					}
				}
			}
		}
	}
	if checked == 0 {
		t.Fatal("no DaemonSet of deploy/ listens on a port of the node: nothing was checked")
	}
}

// kubectlMinimum is the oldest kubectl whose `kubectl apply -k` reads
// every kustomization of deploy/, as docs/operations.md states it. Up to
// 1.20 kubectl embeds kustomize v2.0.3, which knows no `patches:` and
// takes only files as `resources:` (directories were `bases:`); 1.21
// embeds kustomize v4.0.5, which reads both.
const kubectlMinimum = "1.21"

// kustomizeDeprecated are the Kustomization fields current kustomize
// deprecates, with what replaces each.
var kustomizeDeprecated = map[string]string{
	"bases":                 "resources",
	"patchesStrategicMerge": "patches",
	"patchesJson6902":       "patches",
	"commonLabels":          "labels",
	"vars":                  "replacements",
	"imageTags":             "images",
}

// kubectlReads returns the first kubectl minor release (1.N) whose
// embedded kustomize reads field as deploy/'s kustomization in dir uses
// it, or 0 for a field this table does not know.
func kubectlReads(field string, value any, dir string) int {
	switch field {
	case "apiVersion", "kind":
		return 14 // kubectl's first kustomize
	case "patches":
		return 21
	case "resources":
		list, _ := value.([]any)
		for _, r := range list {
			s, _ := r.(string)
			if fi, err := os.Stat(filepath.Join(deployDir, dir, s)); err == nil && fi.IsDir() {
				return 21
			}
		}
		return 14
	}
	return 0
}

// TestDeployKubectlMinimum: every kustomization of deploy/ uses no field
// current kustomize deprecates, the oldest kubectl that reads them all is
// the minimum docs/operations.md and README.md state, and, with kubectl on
// the PATH,
// `kubectl kustomize` builds each with no warning.
func TestDeployKubectlMinimum(t *testing.T) {
	need := 0
	for _, root := range deployRoots(t) {
		data, err := os.ReadFile(filepath.Join(deployDir, root, "kustomization.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		var fields map[string]any
		if err := yaml.Unmarshal(data, &fields); err != nil {
			t.Fatalf("deploy/%s/kustomization.yaml: %v", root, err)
		}
		for f, v := range fields {
			if repl, ok := kustomizeDeprecated[f]; ok {
				t.Errorf("deploy/%s/kustomization.yaml: %s is deprecated; use %s", root, f, repl)
				continue
			}
			minor := kubectlReads(f, v, root)
			if minor == 0 {
				t.Errorf("deploy/%s/kustomization.yaml: field %s: which kubectl reads it is not known to this test", root, f)
			}
			need = max(need, minor)
		}
	}
	if got := fmt.Sprintf("1.%d", need); got != kubectlMinimum {
		t.Errorf("the kustomizations of deploy/ need kubectl %s or later, kubectlMinimum says %s", got, kubectlMinimum)
	}
	for _, file := range []string{operationsDoc, "../../README.md"} {
		doc, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		stated := regexp.MustCompile(`kubectl (1\.\d+) or later`).FindAllStringSubmatch(string(doc), -1)
		if len(stated) == 0 {
			t.Errorf("%s states no minimum kubectl (\"kubectl 1.N or later\"); deploy/ needs %s", file, kubectlMinimum)
		}
		for _, m := range stated {
			if m[1] != kubectlMinimum {
				t.Errorf("%s says kubectl %s or later; deploy/ needs %s", file, m[1], kubectlMinimum)
			}
		}
	}

	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		t.Log("kubectl is not on the PATH: its warnings on deploy/ not checked")
		return
	}
	for _, root := range deployRoots(t) {
		var stderr bytes.Buffer
		cmd := exec.Command(kubectl, "kustomize", filepath.Join(deployDir, root))
		cmd.Stderr = &stderr
		if _, err := cmd.Output(); err != nil {
			t.Errorf("kubectl kustomize deploy/%s: %v\n%s", root, err, stderr.String())
			continue
		}
		if stderr.Len() > 0 {
			t.Errorf("kubectl kustomize deploy/%s warns:\n%s", root, stderr.String())
		}
	}
}

// TestDeployRBACDocumented: the "RBAC" table of docs/operations.md lists
// exactly the (account, API group, resource, verb) grants of deploy/base's
// roles, and explains each verb of a row that has several.
func TestDeployRBACDocumented(t *testing.T) {
	const begin, end = "<!-- rbac:begin -->", "<!-- rbac:end -->"
	doc, err := os.ReadFile(operationsDoc)
	if err != nil {
		t.Fatal(err)
	}
	s := string(doc)
	i, j := strings.Index(s, begin), strings.Index(s, end)
	if i < 0 || j < i {
		t.Fatalf("%s has no RBAC table between %s and %s", operationsDoc, begin, end)
	}
	quoted := regexp.MustCompile("`([^`]+)`")
	names := func(cell string) []string {
		var out []string
		for _, m := range quoted.FindAllStringSubmatch(cell, -1) {
			out = append(out, m[1])
		}
		return out
	}
	type grant struct {
		account string
		apiRequest
	}
	documented := map[grant]bool{}
	for line := range strings.Lines(s[i+len(begin) : j]) {
		cells := strings.Split(strings.Trim(strings.TrimSpace(line), "|"), "|")
		if len(cells) != 5 || !strings.HasPrefix(strings.TrimSpace(cells[0]), "`") {
			continue // the header, its rule, blank lines
		}
		accounts, groups, resources, verbs, why := names(cells[0]), names(cells[1]), names(cells[2]), names(cells[3]), cells[4]
		if len(accounts) == 0 || len(groups) != 1 || len(resources) == 0 || len(verbs) == 0 {
			t.Errorf("RBAC table row %q: want accounts, one group, resources and verbs, each in backquotes", strings.TrimSpace(line))
			continue
		}
		if groups[0] == `""` {
			groups[0] = "" // the core group, as a ClusterRole writes it
		}
		for _, v := range verbs {
			if len(verbs) > 1 && !strings.Contains(why, "`"+v+"`") {
				t.Errorf("RBAC table row of %v: the verb %s is not explained (`%s` in the last column)", resources, v, v)
			}
			for _, a := range accounts {
				for _, r := range resources {
					documented[grant{a, apiRequest{Group: groups[0], Resource: r, Verb: v}}] = true
				}
			}
		}
	}
	granted := map[grant]bool{}
	for _, a := range deployAccounts(t, "base") {
		_, sa, _ := strings.Cut(strings.TrimPrefix(a.user, "system:serviceaccount:"), ":")
		for r := range a.grants() {
			granted[grant{sa, r}] = true
		}
	}
	for g := range granted {
		if !documented[g] {
			t.Errorf("deploy/base grants %s %s on %s to %s, which the RBAC table of %s does not list", g.Verb, g.Resource, g.Group, g.account, operationsDoc)
		}
	}
	for g := range documented {
		if !granted[g] {
			t.Errorf("the RBAC table of %s lists %s %s on %s for %s, which deploy/base does not grant", operationsDoc, g.Verb, g.Resource, g.Group, g.account)
		}
	}
	if len(granted) == 0 {
		t.Fatal("deploy/base grants nothing")
	}
}
