package workloads

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/spf13/pflag"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	coordinationv1client "k8s.io/client-go/kubernetes/typed/coordination/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/identity"
)

// ManagerCell is the identity manager (`identityd manager`): with
// --identity-management-mode operator or both, of its replicas, the one
// that holds the Lease holds the global identity of every pod's label set
// in the cluster, from one watch of all Pods and
// Namespaces and with the agents' label derivation (--label-prefix-file,
// --labels), so that agents with --identity-management-mode=operator only
// adopt them. It creates an identity when a pod has a label set no
// identity has, and releases its reference --identity-change-grace-period
// after no pod has the label set any more; the store's garbage collection
// deletes the identity once no node uses it either. The election is
// client-go's leader election over the coordination.k8s.io Lease
// identityd-manager-<cluster ID> in --identity-manager-lease-namespace,
// with Cilium operator's flags and defaults for its timings. Every replica
// watches the Pods and Namespaces, the standbys too, so that a replica
// that takes the Lease over serves at once. A replica
// that loses the Lease stops its allocations at once (they run on the
// term's context) and stops the process with an error, to start again as
// a candidate; its references end with its store record (its etcd lease,
// its IdentityNode's lease). It needs a Kubernetes client, and in kvstore
// mode the cluster's etcd (--kvstore-endpoints). In agent mode, as
// Cilium's operator, it creates no identity: the process runs the store,
// and with it the store's garbage collection, alone.
var ManagerCell = cell.Module(
	"identity-manager",
	"Global identities of the cluster pods held by one elected manager",

	cell.Config(DefaultConfig),
	cell.Config(DefaultManagerConfig),
	cell.ProvidePrivate(newManager),
	cell.Provide(newMetricsOut),
	cell.Invoke(func(*Workloads) {}),
)

// ManagerConfig is the identity manager's election.
type ManagerConfig struct {
	// IdentityManagerLeaseNamespace is the namespace of the Lease.
	IdentityManagerLeaseNamespace string
	// LeaderElectionLeaseDuration, LeaderElectionRenewDeadline and
	// LeaderElectionRetryPeriod are client-go's leader election timings,
	// under Cilium operator's flag names.
	LeaderElectionLeaseDuration time.Duration
	LeaderElectionRenewDeadline time.Duration
	LeaderElectionRetryPeriod   time.Duration
}

// DefaultManagerConfig has Cilium operator's election timings.
var DefaultManagerConfig = ManagerConfig{
	IdentityManagerLeaseNamespace: "kube-system",
	LeaderElectionLeaseDuration:   15 * time.Second,
	LeaderElectionRenewDeadline:   10 * time.Second,
	LeaderElectionRetryPeriod:     2 * time.Second,
}

// Flags registers the manager's flags.
func (def ManagerConfig) Flags(flags *pflag.FlagSet) {
	flags.String("identity-manager-lease-namespace", def.IdentityManagerLeaseNamespace, "Namespace of the Lease that elects the identity manager")
	flags.Duration("leader-election-lease-duration", def.LeaderElectionLeaseDuration, "How long the other replicas wait before they take the Lease of an identity manager that stopped renewing it")
	flags.Duration("leader-election-renew-deadline", def.LeaderElectionRenewDeadline, "How long the identity manager retries renewing its Lease before it stops managing")
	flags.Duration("leader-election-retry-period", def.LeaderElectionRetryPeriod, "Interval of the tries to take or renew the identity manager's Lease")
}

// Validate checks the timings as client-go does.
func (c ManagerConfig) Validate() error {
	switch {
	case c.IdentityManagerLeaseNamespace == "":
		return errors.New("--identity-manager-lease-namespace must not be empty")
	case c.LeaderElectionRetryPeriod <= 0:
		return fmt.Errorf("--leader-election-retry-period %s must be positive", c.LeaderElectionRetryPeriod)
	case float64(c.LeaderElectionRenewDeadline) <= leaderelection.JitterFactor*float64(c.LeaderElectionRetryPeriod):
		return fmt.Errorf("--leader-election-renew-deadline %s must be more than %g times --leader-election-retry-period %s",
			c.LeaderElectionRenewDeadline, leaderelection.JitterFactor, c.LeaderElectionRetryPeriod)
	case c.LeaderElectionLeaseDuration <= c.LeaderElectionRenewDeadline:
		return fmt.Errorf("--leader-election-lease-duration %s must be more than --leader-election-renew-deadline %s",
			c.LeaderElectionLeaseDuration, c.LeaderElectionRenewDeadline)
	}
	return nil
}

// ErrLostLease: the identity manager lost its Lease and stops.
var ErrLostLease = errors.New("the identity manager lost its Lease")

type managerParams struct {
	cell.In

	Config     Config
	Election   ManagerConfig
	Log        *slog.Logger
	Jobs       job.Registry
	Health     cell.Health `optional:"true"`
	Shutdowner hive.Shutdowner
	Client     *k8sclient.Client `optional:"true"`
	KVStore    *kvstore.Client   `optional:"true"`
	Mode       identity.AllocationMode
	Node       identity.NodeName `optional:"true"`
	Cluster    identity.ClusterInfo
	Allocator  allocator.Allocator
}

func newManager(p managerParams) (*Workloads, error) {
	if err := errors.Join(p.Config.Validate(), p.Election.Validate()); err != nil {
		return nil, err
	}
	switch {
	case p.Client == nil:
		return nil, errors.New("identityd manager needs the Kubernetes API server: --identity-allocation-mode=crd, or --k8s-kubeconfig-path or --k8s-api-server")
	case p.Node == "":
		return nil, errors.New("identityd manager needs --node-name: the name of its record in the store, one per replica")
	case p.Mode.UsesKVStore() && (p.KVStore == nil || p.KVStore.Embedded()):
		return nil, errors.New("identityd manager in kvstore mode needs the cluster's etcd (--kvstore-endpoints): an embedded etcd would be the manager's alone")
	}
	filter, err := p.Config.filter()
	if err != nil {
		return nil, err
	}
	if p.Config.IdentityManagementMode == ManagementModeAgent {
		// As Cilium's operator in agent mode: the nodes create the
		// identities, and the manager runs the store alone, for its
		// garbage collection.
		p.Log.Info("Identity management mode agent: the nodes create the identities; this manager only runs the store's garbage collection")
		if p.Health != nil {
			p.Health.OK("Identity management mode agent: the nodes create the identities")
		}
		return nil, nil
	}
	w := newWorkloads(p.Log, p.Config, filter, "", p.Cluster.Name, p.Allocator, nil, newWorkloadMetrics())
	// The process's instance tells this replica's term from an earlier
	// one of the same node name, as the stores' node claims do.
	id := string(p.Node) + "_" + globalstore.NewNodeClaim().Instance
	name := fmt.Sprintf("identityd-manager-%d", p.Cluster.ID)
	client, el, log := p.Client, p.Election, p.Log
	p.Jobs.NewGroup(health.OrDetached(p.Health)).Add(job.OneShot("identity-manager", func(ctx context.Context, h cell.Health) error {
		cfg := client.RESTConfig()
		if cfg == nil {
			return errors.New("identity manager: the Kubernetes client has no connection settings (its start did not succeed)")
		}
		core, err := corev1client.NewForConfig(cfg)
		if err != nil {
			return fmt.Errorf("identity manager: %w", err)
		}
		coord, err := coordinationv1client.NewForConfig(cfg)
		if err != nil {
			return fmt.Errorf("identity manager: %w", err)
		}
		// A standby replica keeps every pod and namespace listed and
		// watched, so that the replica that takes the Lease over serves
		// at once instead of listing the cluster's pods first.
		wctx, cancelWatch := context.WithCancel(ctx)
		listed := w.watch(wctx, h, core)
		defer func() { cancelWatch(); listed.wait() }()
		lost := false
		le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
			Name: name,
			Lock: &resourcelock.LeaseLock{
				LeaseMeta:  metav1.ObjectMeta{Name: name, Namespace: el.IdentityManagerLeaseNamespace},
				Client:     coord,
				LockConfig: resourcelock.ResourceLockConfig{Identity: id},
			},
			LeaseDuration:   el.LeaderElectionLeaseDuration,
			RenewDeadline:   el.LeaderElectionRenewDeadline,
			RetryPeriod:     el.LeaderElectionRetryPeriod,
			ReleaseOnCancel: true,
			Callbacks: leaderelection.LeaderCallbacks{
				OnStartedLeading: func(ctx context.Context) {
					log.Info("This replica manages the identities of the cluster's pods", "lease", el.IdentityManagerLeaseNamespace+"/"+name, "identity", id)
					w.serveListed(ctx, h, listed)
				},
				OnStoppedLeading: func() { lost = ctx.Err() == nil },
				OnNewLeader: func(holder string) {
					if holder != id {
						h.OK(fmt.Sprintf("Standing by: %s manages the identities (Lease %s/%s)", holder, el.IdentityManagerLeaseNamespace, name))
					}
				},
			},
		})
		if err != nil {
			return fmt.Errorf("identity manager: %w", err)
		}
		h.OK(fmt.Sprintf("Campaigning for the Lease %s/%s", el.IdentityManagerLeaseNamespace, name))
		le.Run(ctx)
		if lost {
			err := fmt.Errorf("%w %s/%s: stopping, to start again as a candidate", ErrLostLease, el.IdentityManagerLeaseNamespace, name)
			log.Error("The identity manager lost its Lease", "error", err)
			p.Shutdowner.Shutdown(hive.ShutdownWithError(err))
		}
		return nil
	}))
	return w, nil
}
