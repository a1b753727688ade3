package workloads

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/ipcache"
	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/cells/metrics"
	"github.com/identityd/identityd/identity"
)

// Cell gives the node's pods their identities when the hive has a
// Kubernetes client (crd mode, or a kubeconfig or API server configured):
// it provides *Workloads (nil without a client), the workloads/list
// command and the workloads metrics. See the package documentation.
var Cell = cell.Module(
	"workloads",
	"Identities of the pods of this node",

	cell.Config(DefaultConfig),
	cell.Provide(newCell, newCommands, newMetricsOut, adoptOnly),
)

// adoptOnly tells the stores that a node in operator mode writes no
// global identity.
func adoptOnly(c Config) globalstore.AdoptOnly {
	return globalstore.AdoptOnly(c.IdentityManagementMode == ManagementModeOperator)
}

type params struct {
	cell.In

	Config    Config
	Log       *slog.Logger
	Lifecycle cell.Lifecycle
	Jobs      job.Registry
	Health    cell.Health `optional:"true"`
	// Client is nil when the agent uses no Kubernetes API server: the
	// cell is off.
	Client    *k8sclient.Client `optional:"true"`
	Node      identity.NodeName `optional:"true"`
	Cluster   identity.ClusterInfo
	Allocator allocator.Allocator
	// AllocatorConfig gives --identity-allocation-timeout, how long a pod
	// waits in operator mode before the wait is reported.
	AllocatorConfig allocator.Config
	IPCache         *ipcache.IPCache
}

// ErrNoNodeName: the cell needs this node's name to select its pods.
var ErrNoNodeName = errors.New("workloads: no node name (--node-name) to select this node's pods")

func newCell(p params) (*Workloads, error) {
	if err := p.Config.Validate(); err != nil {
		return nil, err
	}
	filter, err := p.Config.filter()
	if err != nil {
		return nil, err
	}
	h := health.OrDetached(p.Health)
	if p.Client == nil {
		const off = "No Kubernetes API server in use (neither crd mode nor --k8s-kubeconfig-path or --k8s-api-server): pods get no identities from this node"
		p.Log.Info(off)
		h.OK(off)
		return nil, nil
	}
	if p.Node == "" {
		return nil, ErrNoNodeName
	}
	m := newWorkloadMetrics()
	w := newWorkloads(p.Log, p.Config, filter, string(p.Node), p.Cluster.Name, p.Allocator, p.IPCache, m)
	w.createTimeout = p.AllocatorConfig.IdentityAllocationTimeout
	// Registered before any hook runs: the ipcache prunes nothing of the
	// datapath map until the pods of the first listing are back in it.
	w.initDone = p.IPCache.RegisterInitializer("workloads")
	client := p.Client
	p.Jobs.NewGroup(h).Add(job.OneShot("workloads", func(ctx context.Context, h cell.Health) error {
		cfg := client.RESTConfig()
		if cfg == nil {
			return errors.New("workloads: the Kubernetes client has no connection settings (its start did not succeed)")
		}
		core, err := corev1client.NewForConfig(cfg)
		if err != nil {
			return fmt.Errorf("workloads: %w", err)
		}
		return w.run(ctx, h, core)
	}))
	return w, nil
}

func newMetricsOut(w *Workloads) metrics.CollectorOut {
	if w == nil {
		return metrics.CollectorOut{}
	}
	return metrics.NewCollector(w.metrics)
}

// run watches the node's pods and the namespaces, and serves the pods once
// both are listed.
func (w *Workloads) run(ctx context.Context, h cell.Health, core corev1client.CoreV1Interface) error {
	ctx, cancel := context.WithCancel(ctx)
	l := w.watch(ctx, h, core)
	defer func() { cancel(); l.wait() }()
	w.serveListed(ctx, h, l)
	return nil
}

// listing is the informers of watch.
type listing struct {
	synced func() bool
	// keys returns the keys of the pods listed.
	keys func() []string
	// namespaces counts the namespaces listed.
	namespaces func() int
	// wait returns once the informers ended with their context.
	wait func()
}

// watch starts the informers of the pods (of the node, or every pod for
// the manager) and of the namespaces, which run until ctx ends. Their
// events mark pods dirty; serveListed serves them.
func (w *Workloads) watch(ctx context.Context, h cell.Health, core corev1client.CoreV1Interface) listing {
	logger := logr.FromSlogHandler(w.log.Handler())
	// The manager (no node) reads every pod of the cluster.
	var nodeSelector string
	if w.node != "" {
		nodeSelector = fields.OneTermEqualSelector("spec.nodeName", w.node).String()
	}
	whose := w.whosePods()
	// A failed listing or watch shows in the module's health message,
	// not in readiness: the node's other identities are served all the
	// same, and client-go retries with its backoff.
	report := func(what string, err error) {
		if err != nil && ctx.Err() == nil {
			h.OK(fmt.Sprintf("%s failed, retrying: %v", what, err))
		}
	}
	podLW := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			opts.FieldSelector = nodeSelector
			l, err := core.Pods(metav1.NamespaceAll).List(ctx, opts)
			report("Listing "+whose, err)
			return l, err
		},
		WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			opts.FieldSelector = nodeSelector
			wi, err := core.Pods(metav1.NamespaceAll).Watch(ctx, opts)
			report("Watching "+whose, err)
			return wi, err
		},
	}
	nsLW := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			l, err := core.Namespaces().List(ctx, opts)
			report("Listing the namespaces", err)
			return l, err
		},
		WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			wi, err := core.Namespaces().Watch(ctx, opts)
			report("Watching the namespaces", err)
			return wi, err
		},
	}
	podKey := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			w.markDirty(key)
		}
	}
	podStore, podCtl := cache.NewInformerWithOptions(cache.InformerOptions{
		Logger:        &logger,
		ListerWatcher: podLW,
		ObjectType:    &corev1.Pod{},
		Handler: cache.ResourceEventHandlerFuncs{
			AddFunc:    podKey,
			UpdateFunc: func(_, obj any) { podKey(obj) },
			DeleteFunc: podKey,
		},
		Indexers:  cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc},
		Transform: slimPod,
	})
	w.src.pods = podStore.(cache.Indexer)
	nsName := func(obj any) string {
		key, _ := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
		return key
	}
	nsStore, nsCtl := cache.NewInformerWithOptions(cache.InformerOptions{
		Logger:        &logger,
		ListerWatcher: nsLW,
		ObjectType:    &corev1.Namespace{},
		Handler: cache.ResourceEventHandlerFuncs{
			AddFunc: func(obj any) { w.markNamespace(nsName(obj)) },
			UpdateFunc: func(old, obj any) {
				o, _ := old.(*corev1.Namespace)
				n, _ := obj.(*corev1.Namespace)
				if o == nil || n == nil || !maps.Equal(o.Labels, n.Labels) {
					w.markNamespace(nsName(obj))
				}
			},
			DeleteFunc: func(obj any) { w.markNamespace(nsName(obj)) },
		},
		Transform: slimNamespace,
	})
	w.src.namespaces = nsStore

	done := make(chan struct{}, 2)
	go func() { podCtl.RunWithContext(ctx); done <- struct{}{} }()
	go func() { nsCtl.RunWithContext(ctx); done <- struct{}{} }()
	return listing{
		synced:     func() bool { return podCtl.HasSynced() && nsCtl.HasSynced() },
		keys:       podStore.ListKeys,
		namespaces: func() int { return len(nsStore.ListKeys()) },
		wait:       func() { <-done; <-done },
	}
}

// serveListed waits until l has listed the pods and the namespaces, and
// serves the pods until ctx ends.
func (w *Workloads) serveListed(ctx context.Context, h cell.Health, l listing) {
	whose := w.whosePods()
	h.OK("Listing " + whose + " and the namespaces")
	start := w.now()
	w.initDeadline = start.Add(initialHoldBound)
	poll := time.NewTicker(100 * time.Millisecond)
	defer poll.Stop()
	for !l.synced() {
		if w.initDone != nil && !w.now().Before(w.initDeadline) {
			w.log.Warn("This node's pods are not listed yet: the ipcache may now prune their entries from the datapath map", "after", initialHoldBound)
			w.initDone()
			w.initDone = nil
		}
		select {
		case <-ctx.Done():
			return
		case <-poll.C:
		}
	}
	keys := l.keys()
	w.log.Info("Listed "+whose+" and the namespaces", "node", w.node, "pods", len(keys),
		"namespaces", l.namespaces(), "duration", w.now().Sub(start))
	w.markDirty(keys...)
	h.OK("Serving " + whose)
	w.health = h
	w.serve(ctx)
}
