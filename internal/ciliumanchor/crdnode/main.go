// Command crdnode is a Cilium v1.16.2 agent's global identity allocation in
// CRD mode, and nothing else: Cilium's own CachingIdentityAllocator,
// initialized by InitIdentityAllocator as the agent does with
// --identity-allocation-mode=crd, so that its allocator (pkg/allocator), its
// CRD backend (pkg/k8s/identitybackend) and its CiliumIdentity informer run
// unchanged against the API server of a kubeconfig. identityd's tests run it
// as a process beside identityd's CRD store on one API server, to check that
// both see, create and adopt each other's identities with equal IDs.
//
//	crdnode -kubeconfig FILE [-lookup] [-register-crd] [-cluster-id N] [-timeout D] [-parallel N] [-qps Q -burst B]
//
// It reads one label set per line from stdin and answers each on a line of
// its own, as soon as it is settled (with -parallel N, N label sets at a
// time, as N of an agent's endpoints would ask, so answers may come in
// another order than the input's):
//
//	<id>\t<labels>          allocated (or, with -lookup, found; 0: none)
//	error\t<labels>\t<msg>  Cilium gave up within -timeout
//
// <labels> is the label set's key as Cilium's allocator writes it
// (source:key=value; per label, sorted by key), which is identityd's
// canonical form. An input line is either a JSON array of labels in text
// form (["k8s:app=web","k8s:io.kubernetes.pod.namespace=prod"], parsed by
// Cilium's labels.NewLabelsFromModel, as the agent's API does), a JSON
// object of security-labels ({"k8s:app":"web"}, parsed by labels.Map2Labels
// as the CRD backend reads an object), or labels in text form separated by
// spaces, as identityd's shell takes them (no quoting: use JSON for values
// with spaces). Empty lines are skipped.
//
// -qps and -burst are the client's rate limit, as Cilium's --k8s-client-qps
// and --k8s-client-burst (client-go's defaults, 5 and 10, without them).
//
// -register-crd installs or updates the CiliumIdentity CRD from Cilium's
// pregenerated schema the way Cilium's operator does, before anything else.
//
// It is a program of the ciliumanchor module: Cilium's dependencies
// (client-go v0.30) never enter identityd's build.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/cilium/cilium/pkg/identity"
	"github.com/cilium/cilium/pkg/identity/cache"
	"github.com/cilium/cilium/pkg/identity/key"
	k8sconst "github.com/cilium/cilium/pkg/k8s/apis/cilium.io"
	ciliumclient "github.com/cilium/cilium/pkg/k8s/apis/cilium.io/client"
	k8sconstv2 "github.com/cilium/cilium/pkg/k8s/apis/cilium.io/v2"
	"github.com/cilium/cilium/pkg/k8s/apis/crdhelpers"
	clientset "github.com/cilium/cilium/pkg/k8s/client/clientset/versioned"
	"github.com/cilium/cilium/pkg/labels"
	"github.com/cilium/cilium/pkg/logging"
	"github.com/cilium/cilium/pkg/option"
	"github.com/cilium/cilium/pkg/versioncheck"
)

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the API server (required)")
	lookup := flag.Bool("lookup", false, "only look label sets up (LookupIdentity), never allocate")
	registerCRD := flag.Bool("register-crd", false, "install or update the CiliumIdentity CRD as Cilium's operator does, first")
	clusterID := flag.Uint("cluster-id", 0, "Cilium's --cluster-id: the range of IDs allocated")
	timeout := flag.Duration("timeout", 30*time.Second, "how long one label set may take before it is answered with an error")
	debug := flag.Bool("debug", false, "log Cilium's debug messages to stderr")
	parallel := flag.Int("parallel", 1, "how many label sets are allocated at a time")
	qps := flag.Float64("qps", 0, "the client's queries per second (Cilium's --k8s-client-qps; 0: client-go's default)")
	burst := flag.Int("burst", 0, "the client's burst (Cilium's --k8s-client-burst; 0: client-go's default)")
	flag.Parse()
	if *kubeconfig == "" || flag.NArg() != 0 || *parallel < 1 {
		fmt.Fprintln(os.Stderr, "usage: crdnode -kubeconfig FILE [-lookup] [-register-crd] [-cluster-id N] [-timeout D] [-parallel N] [-qps Q -burst B] < label sets")
		os.Exit(2)
	}
	if err := run(*kubeconfig, *lookup, *registerCRD, uint32(*clusterID), *timeout, *parallel, float32(*qps), *burst, *debug); err != nil {
		fmt.Fprintln(os.Stderr, "crdnode:", err)
		os.Exit(1)
	}
}

// owner is what Cilium's allocator needs of its agent: nothing here.
type owner struct{}

func (owner) UpdateIdentities(added, deleted identity.IdentityMap) {}
func (owner) GetNodeSuffix() string                                { return "crdnode" }

func run(kubeconfig string, lookupOnly, registerCRD bool, clusterID uint32, timeout time.Duration, parallel int, qps float32, burst int, debug bool) error {
	logging.DefaultLogger.SetOutput(os.Stderr)
	logging.DefaultLogger.SetLevel(logrus.InfoLevel)
	if debug {
		logging.DefaultLogger.SetLevel(logrus.DebugLevel)
		option.Config.Debug = true
	}
	failures := &lastFailure{byKey: map[string]string{}}
	logging.DefaultLogger.AddHook(failures)

	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return fmt.Errorf("reading %s: %w", kubeconfig, err)
	}
	cfg.QPS, cfg.Burst = qps, burst
	if registerCRD {
		ext, err := apiextensionsclient.NewForConfig(cfg)
		if err != nil {
			return err
		}
		if err := registerIdentityCRD(ext); err != nil {
			return err
		}
	}
	client, err := clientset.NewForConfig(cfg)
	if err != nil {
		return err
	}

	option.Config.IdentityAllocationMode = option.IdentityAllocationModeCRD
	option.Config.ClusterID = clusterID
	m := cache.NewCachingIdentityAllocator(owner{})
	<-m.InitIdentityAllocator(client)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	err = m.WaitForInitialGlobalIdentities(ctx)
	cancel()
	if err != nil {
		return err
	}

	var out sync.Mutex
	answer := func(format string, args ...any) {
		out.Lock()
		defer out.Unlock()
		fmt.Printf(format, args...)
	}
	lines := make(chan string)
	var workers sync.WaitGroup
	for range parallel {
		workers.Go(func() {
			for line := range lines {
				settle(m, failures, line, lookupOnly, timeout, answer)
			}
		})
	}
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 64<<10), 1<<20)
	for in.Scan() {
		if line := strings.TrimSpace(in.Text()); line != "" {
			lines <- line
		}
	}
	close(lines)
	workers.Wait()
	return in.Err()
}

// settle allocates (or looks up) the label set of one input line and
// answers it.
func settle(m *cache.CachingIdentityAllocator, failures *lastFailure, line string, lookupOnly bool, timeout time.Duration, answer func(string, ...any)) {
	lbls, err := parseLine(line)
	if err != nil {
		answer("error\t%s\t%v\n", line, err)
		return
	}
	k := (&key.GlobalIdentity{LabelArray: lbls.LabelArray()}).GetKey()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if lookupOnly {
		var n identity.NumericIdentity
		if id := m.LookupIdentity(ctx, lbls); id != nil {
			n = id.ID
		}
		answer("%d\t%s\n", n, k)
		return
	}
	id, _, err := m.AllocateIdentity(ctx, lbls, false, 0)
	if err != nil {
		if last := failures.take(k); last != "" {
			err = fmt.Errorf("%w; last attempt: %s", err, last)
		}
		answer("error\t%s\t%s\n", k, oneLine(err.Error()))
		return
	}
	answer("%d\t%s\n", id.ID, k)
}

// parseLine reads one label set with Cilium's own label parsing.
func parseLine(line string) (labels.Labels, error) {
	switch line[0] {
	case '[':
		var strs []string
		if err := json.Unmarshal([]byte(line), &strs); err != nil {
			return nil, err
		}
		return labels.NewLabelsFromModel(strs), nil
	case '{':
		var m map[string]string
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			return nil, err
		}
		return labels.Map2Labels(m, ""), nil
	}
	return labels.NewLabelsFromModel(strings.Fields(line)), nil
}

// registerIdentityCRD is what Cilium's operator does for the CiliumIdentity
// CRD (pkg/k8s/apis/cilium.io/client: createCRD and constructV1CRD, which
// are not exported): its pregenerated schema, labelled with Cilium's schema
// version, created or updated by crdhelpers.CreateUpdateCRD.
func registerIdentityCRD(ext apiextensionsclient.Interface) error {
	template := ciliumclient.GetPregeneratedCRD(ciliumclient.CIDCRDName)
	crd := &apiextensionsv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{
			Name: k8sconstv2.CIDName,
			Labels: map[string]string{
				k8sconst.CustomResourceDefinitionSchemaVersionKey: k8sconst.CustomResourceDefinitionSchemaVersion,
			},
		},
		Spec: apiextensionsv1.CustomResourceDefinitionSpec{
			Group: k8sconst.CustomResourceDefinitionGroup,
			Names: apiextensionsv1.CustomResourceDefinitionNames{
				Kind:       template.Spec.Names.Kind,
				Plural:     template.Spec.Names.Plural,
				ShortNames: template.Spec.Names.ShortNames,
				Singular:   template.Spec.Names.Singular,
				Categories: template.Spec.Names.Categories,
			},
			Scope:      template.Spec.Scope,
			Versions:   template.Spec.Versions,
			Conversion: template.Spec.Conversion,
		},
	}
	return crdhelpers.CreateUpdateCRD(ext, crd, crdhelpers.NewDefaultPoller(),
		k8sconst.CustomResourceDefinitionSchemaVersionKey,
		versioncheck.MustVersion(k8sconst.CustomResourceDefinitionSchemaVersion))
}

// lastFailure keeps, per label set, the error of Cilium's last failed
// allocation attempt ("Key allocation attempt failed"), which Allocate
// itself replaces with the context's error when it gives up.
type lastFailure struct {
	mu    sync.Mutex
	byKey map[string]string
}

func (h *lastFailure) Levels() []logrus.Level { return []logrus.Level{logrus.WarnLevel} }

func (h *lastFailure) Fire(e *logrus.Entry) error {
	err, ok := e.Data[logrus.ErrorKey].(error)
	if !ok {
		return nil
	}
	gi, ok := e.Data["key"].(*key.GlobalIdentity)
	if !ok {
		return nil
	}
	h.mu.Lock()
	h.byKey[gi.GetKey()] = oneLine(err.Error())
	h.mu.Unlock()
	return nil
}

func (h *lastFailure) take(k string) string {
	h.mu.Lock()
	defer h.mu.Unlock()
	v := h.byKey[k]
	delete(h.byKey, k)
	return v
}

func oneLine(s string) string {
	return strings.NewReplacer("\n", " ", "\t", " ").Replace(s)
}
