package clustermesh

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/identityd/identityd/internal/retry"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/health"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// Mesh follows the global identities of remote clusters: for each
// file of --clustermesh-config, a read-only list+watch of that cluster's
// master keys in its own etcd. It never allocates, releases or collects
// anything there. Accepted identities reach the allocator's lookups, its
// Observe stream and identity handlers with source SourceRemote; an entry
// whose ID lies outside the remote cluster's range, or whose labels do not
// name the remote cluster, is logged, counted and ignored.
//
// The directory is polled every second: a new file connects a cluster, a
// changed one (or a changed certificate, key or password file it names)
// reconnects it, reporting only the identities that differ, and a removed
// one disconnects it and deletes all its identities. A cluster unreachable
// for longer than --clustermesh-remote-timeout has its identities deleted
// too, until it answers again.
type Mesh struct {
	cfg   Config
	local identity.ClusterInfo
	log   *slog.Logger
	// events receives the remote identities' changes (the allocator's).
	events globalstore.Events
	// life ends when the mesh's hook stops; every cluster's loops run on
	// it: clusters come and go with the directory, so their loops are not
	// jobs, which run as long as the hive.
	life context.Context

	mu       sync.RWMutex
	clusters map[string]*remoteCluster
	// invalid holds configuration errors by file name; a cluster whose
	// new file is invalid keeps running with its previous one.
	invalid  map[string]*configFile
	reported map[string]string // name -> fingerprint whose error was logged

	cancel context.CancelFunc
}

type params struct {
	cell.In

	Cluster identity.ClusterInfo
	Config  Config
	Log     *slog.Logger
	Jobs    job.Registry
	Health  cell.Health `optional:"true"`
	// Sinks is where the mesh reports; a hive without an allocator
	// leaves its Sink unbound.
	Sinks     *globalstore.Sinks `optional:"true"`
	Lifecycle cell.Lifecycle
}

type out struct {
	cell.Out

	Mesh   *Mesh
	Remote globalstore.Remote
}

func newMesh(p params) (out, error) {
	if err := p.Config.Validate(); err != nil {
		return out{}, err
	}
	h := health.OrDetached(p.Health)
	m := newUnstarted(p.Log, p.Config, p.Cluster, p.Sinks.Remote())
	if p.Config.ClusterMeshConfig == "" {
		// Nothing else reports to the module when no cluster is
		// configured; a scope that never reports reads as unknown.
		h.OK("No remote clusters: --clustermesh-config is empty")
	} else {
		h.OK("Following the remote clusters of " + p.Config.ClusterMeshConfig)
		m.register(p.Lifecycle, p.Jobs.NewGroup(h))
	}
	return out{Mesh: m, Remote: m}, nil
}

// newUnstarted returns the remote cluster manager of the local cluster,
// reporting to events, with nothing registered to run.
func newUnstarted(log *slog.Logger, cfg Config, local identity.ClusterInfo, events globalstore.Events) *Mesh {
	return &Mesh{
		cfg:      cfg,
		local:    local,
		log:      log,
		events:   events,
		clusters: map[string]*remoteCluster{},
		invalid:  map[string]*configFile{},
		reported: map[string]string{},
	}
}

var _ globalstore.Remote = (*Mesh)(nil)

// register makes the mesh start with the hive: its start hook reads the
// directory at once, so that clusters configured at start begin connecting
// before the allocator starts, and the job clustermesh-config-poll polls
// it. The hook stops after the job: it disconnects every cluster without
// deleting its identities (the allocator stopped before).
func (m *Mesh) register(lc cell.Lifecycle, g job.Group) {
	lc.Append(cell.Hook{
		OnStart: func(ctx cell.HookContext) error {
			m.life, m.cancel = context.WithCancel(context.Background())
			m.sync(ctx)
			return nil
		},
		OnStop: m.stop,
	})
	g.Add(job.OneShot("clustermesh-config-poll", func(ctx context.Context, _ cell.Health) error {
		t := time.NewTicker(clusterMeshPollInterval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-t.C:
				m.sync(ctx)
			}
		}
	}))
}

// stop ends every cluster's loops and disconnects it.
func (m *Mesh) stop(ctx cell.HookContext) error {
	m.cancel()
	m.mu.Lock()
	clusters := m.clusters
	m.clusters = map[string]*remoteCluster{}
	m.mu.Unlock()
	for _, rc := range clusters {
		rc.stop(ctx)
	}
	return nil
}

// sync brings the running clusters in step with the directory.
func (m *Mesh) sync(ctx context.Context) {
	files, err := readConfigDir(m.cfg.ClusterMeshConfig, m.local)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			// Keep what runs: an unreadable directory says
			// nothing about the clusters.
			m.reportOnce("", err.Error(), err)
			return
		}
		// A missing directory configures no cluster.
		m.reportOnce("", err.Error(), err)
		files = map[string]*configFile{}
	} else {
		m.reportOnce("", "", nil)
	}

	m.mu.Lock()
	running := maps2slice(m.clusters)
	m.mu.Unlock()

	// Removed files: disconnect and withdraw.
	for _, rc := range running {
		if _, ok := files[rc.name]; ok {
			continue
		}
		m.log.Info("Remote cluster removed from --clustermesh-config; withdrawing its identities", "cluster", rc.name)
		m.mu.Lock()
		delete(m.clusters, rc.name)
		m.mu.Unlock()
		rc.stop(ctx)
		rc.cache.Clear()
	}

	invalid := map[string]*configFile{}
	for name, f := range files {
		m.mu.RLock()
		rc := m.clusters[name]
		m.mu.RUnlock()
		if f.err != nil {
			invalid[name] = f
			if rc != nil {
				m.reportOnce(name, f.fingerprint, fmt.Errorf("%w; the cluster stays connected with its previous configuration", f.err))
			} else {
				m.reportOnce(name, f.fingerprint, f.err)
			}
			continue
		}
		m.reportOnce(name, "", nil)
		if rc != nil && rc.fingerprint == f.fingerprint {
			continue
		}
		if rc != nil {
			m.log.Info("Configuration of remote cluster changed; reconnecting", "cluster", name)
			rc.stop(ctx)
		} else {
			m.log.Info("Connecting to remote cluster", "cluster", name, "cluster-id", f.cfg.ClusterID, "endpoints", f.cfg.Endpoints)
		}
		next := newRemoteCluster(m, name, f, rc)
		m.mu.Lock()
		m.clusters[name] = next
		m.mu.Unlock()
		next.start(m.life)
	}
	m.mu.Lock()
	m.invalid = invalid
	m.mu.Unlock()
}

func maps2slice(m map[string]*remoteCluster) []*remoteCluster {
	out := make([]*remoteCluster, 0, len(m))
	for _, rc := range m {
		out = append(out, rc)
	}
	return out
}

// reportOnce logs a configuration error once per version of the file, and
// forgets it once the file is fixed (err nil).
func (m *Mesh) reportOnce(name, fingerprint string, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err == nil {
		delete(m.reported, name)
		return
	}
	if old, ok := m.reported[name]; ok && old == fingerprint {
		return
	}
	m.reported[name] = fingerprint
	if name == "" {
		m.log.Error("Cannot read the remote cluster configurations", "error", err)
		return
	}
	m.log.Error("Invalid remote cluster configuration", "cluster", name, "error", err)
}

// clusterByID returns the running cluster with this cluster ID.
func (m *Mesh) clusterByID(id uint32) *remoteCluster {
	m.mu.RLock()
	defer m.mu.RUnlock()
	for _, rc := range m.clusters {
		if rc.info.ID == id {
			return rc
		}
	}
	return nil
}

// LookupByID returns the labels of a remote cluster's identity.
func (m *Mesh) LookupByID(id identity.NumericIdentity) (labels.Labels, bool) {
	if id.Scope() != identity.ScopeGlobal {
		return nil, false
	}
	rc := m.clusterByID(identity.ClusterID(id, maxConnected(m.local)))
	if rc == nil {
		return nil, false
	}
	return rc.cache.LookupByID(id)
}

// LookupByLabels returns the numeric identity of a remote cluster's label
// set, found through its cluster label.
func (m *Mesh) LookupByLabels(lbls labels.Labels) (identity.NumericIdentity, bool) {
	l, ok := lbls.Get(identity.ClusterLabelKey)
	if !ok {
		return 0, false
	}
	m.mu.RLock()
	rc := m.clusters[l.Value]
	m.mu.RUnlock()
	if rc == nil {
		return 0, false
	}
	return rc.cache.LookupByLabels(lbls)
}

// RemoteClusterStatus is the state of one remote cluster (or of a file of
// --clustermesh-config that configures none).
type RemoteClusterStatus struct {
	// Name is the cluster's name, its file's name.
	Name      string   `json:"name"`
	ClusterID uint32   `json:"cluster-id"`
	Endpoints []string `json:"endpoints"`
	// Connected is true while the cluster's etcd answers.
	Connected bool `json:"connected"`
	// Synced is true once its identities were listed (and not withdrawn
	// since).
	Synced bool `json:"synced"`
	// Identities is the number of its identities this node knows.
	Identities int `json:"identities"`
	// Rejected is the number of its master keys currently refused;
	// RejectedTotal counts every refusal since the cluster was added.
	Rejected      int    `json:"rejected"`
	RejectedTotal uint64 `json:"rejected-total"`
	// LastError is the last connection or configuration error, empty
	// when none is pending.
	LastError string `json:"last-error,omitempty"`
}

// TableHeader names the columns of clustermesh/status's table.
func (RemoteClusterStatus) TableHeader() []string {
	return []string{"Name", "ID", "Connected", "Synced", "Identities", "Rejected", "LastError"}
}

// TableRow is s as a row of clustermesh/status's table.
func (s RemoteClusterStatus) TableRow() []string {
	return []string{
		s.Name, strconv.FormatUint(uint64(s.ClusterID), 10), strconv.FormatBool(s.Connected),
		strconv.FormatBool(s.Synced), strconv.Itoa(s.Identities), strconv.Itoa(s.Rejected), s.LastError,
	}
}

// Status returns the state of every remote cluster, by name.
func (m *Mesh) Status() []RemoteClusterStatus {
	if m == nil {
		return nil
	}
	m.mu.RLock()
	var out []RemoteClusterStatus
	for _, rc := range m.clusters {
		st := rc.status()
		if f := m.invalid[rc.name]; f != nil {
			st.LastError = f.err.Error()
		}
		out = append(out, st)
	}
	for name, f := range m.invalid {
		if _, running := m.clusters[name]; !running {
			out = append(out, RemoteClusterStatus{Name: name, ClusterID: f.cfg.ClusterID, Endpoints: f.cfg.Endpoints, LastError: f.err.Error()})
		}
	}
	m.mu.RUnlock()
	slices.SortFunc(out, func(a, b RemoteClusterStatus) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// remoteCluster is the connection to one remote cluster and the cache of
// its master keys.
type remoteCluster struct {
	name        string
	fingerprint string
	cfg         RemoteClusterConfig
	info        identity.ClusterInfo
	log         *slog.Logger
	timeout     time.Duration
	events      globalstore.Events
	cache       *etcdstore.Follower
	// clusterLabel is the label every identity of the cluster carries.
	clusterLabel labels.Label

	mu        sync.Mutex
	kv        *kvstore.Client
	connected bool
	lastErr   string
	lastOK    time.Time
	withdrawn bool

	cancel context.CancelFunc
	wg     sync.WaitGroup
}

func newRemoteCluster(m *Mesh, name string, f *configFile, prev *remoteCluster) *remoteCluster {
	rc := &remoteCluster{
		name:         name,
		fingerprint:  f.fingerprint,
		cfg:          f.cfg,
		info:         identity.ClusterInfo{ID: f.cfg.ClusterID, Name: name, MaxConnectedClusters: maxConnected(m.local)},
		log:          m.log.With("cluster", name),
		timeout:      m.cfg.ClusterMeshRemoteTimeout,
		events:       m.events,
		clusterLabel: labels.Label{Source: labels.SourceK8s, Key: identity.ClusterLabelKey, Value: name},
		lastOK:       time.Now(),
	}
	var prevCache *etcdstore.Follower
	if prev != nil {
		// The new connection's first listing reports only what
		// differs from what the previous one knew; until then, and
		// for the timeout if it never connects, those identities stay.
		prevCache = prev.cache
	}
	rc.cache = etcdstore.NewFollower(rc.log, rc, "identities of remote cluster "+name, etcdstore.FollowerHooks{
		Validate: rc.validate,
		Events:   m.events,
		Listed:   rc.listed,
		Failed:   rc.failed,
	}, prevCache)
	if prev != nil {
		prev.mu.Lock()
		rc.lastOK, rc.withdrawn = prev.lastOK, prev.withdrawn
		prev.mu.Unlock()
	}
	return rc
}

// Client implements etcdstore.Source.
func (rc *remoteCluster) Client() *clientv3.Client {
	rc.mu.Lock()
	kv := rc.kv
	rc.mu.Unlock()
	if kv == nil {
		return nil
	}
	return kv.Client()
}

// RequestTimeout implements etcdstore.Source.
func (rc *remoteCluster) RequestTimeout() time.Duration { return remoteRequestTimeout }

// remoteRequestTimeout bounds one request to a remote cluster's etcd.
const remoteRequestTimeout = 10 * time.Second

// validate rejects what the remote cluster may not claim: IDs outside its
// range (they would shadow this or a third cluster's identities) and
// label sets that do not name it.
func (rc *remoteCluster) validate(id identity.NumericIdentity, lbls labels.Labels) error {
	if id < rc.info.MinID() || id > rc.info.MaxID() {
		return fmt.Errorf("identity %d is outside cluster %s's range %d..%d", id, rc.name, rc.info.MinID(), rc.info.MaxID())
	}
	if !lbls.Has(rc.clusterLabel) {
		return fmt.Errorf("labels lack %s", rc.clusterLabel)
	}
	return nil
}

func (rc *remoteCluster) listed() {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rc.connected, rc.lastErr, rc.lastOK, rc.withdrawn = true, "", time.Now(), false
}

func (rc *remoteCluster) failed(err error) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rc.connected, rc.lastErr = false, err.Error()
}

func (rc *remoteCluster) start(life context.Context) {
	ctx, cancel := context.WithCancel(life)
	rc.cancel = cancel
	rc.wg.Go(func() { rc.run(ctx) })
	rc.wg.Go(func() { rc.watchdog(ctx) })
}

// stop ends the connection, keeping the cache for a successor or for the
// caller to clear.
func (rc *remoteCluster) stop(ctx context.Context) {
	rc.cancel()
	rc.wg.Wait()
	rc.mu.Lock()
	kv := rc.kv
	rc.kv, rc.connected = nil, false
	rc.mu.Unlock()
	if kv != nil {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if err := kv.Stop(ctx); err != nil {
			rc.log.Warn("Closing the connection to the remote cluster failed", "error", err)
		}
	}
}

// run connects, retrying until it succeeds, then keeps the cache.
func (rc *remoteCluster) run(ctx context.Context) {
	cfg := kvstore.DefaultConfig
	cfg.KVStoreEndpoints = rc.cfg.Endpoints
	cfg.KVStoreCAFile = rc.cfg.CAFile
	cfg.KVStoreCertFile = rc.cfg.CertFile
	cfg.KVStoreKeyFile = rc.cfg.KeyFile
	cfg.KVStoreUsername = rc.cfg.Username
	cfg.KVStorePasswordFile = rc.cfg.PasswordFile
	cfg.KVStoreDialTimeout = remoteRequestTimeout
	cfg.KVStoreRequestTimeout = remoteRequestTimeout
	// Nothing is written there: the name only fills the client's status.
	cfg.NodeName = "clustermesh-reader"
	for attempt := 1; ctx.Err() == nil; attempt++ {
		kv, err := kvstore.New(rc.log, cfg, nil)
		if err == nil {
			err = kv.Start(ctx)
		}
		if err == nil {
			rc.mu.Lock()
			rc.kv = kv
			rc.mu.Unlock()
			rc.cache.Run(ctx)
			return
		}
		if ctx.Err() != nil {
			return
		}
		rc.failed(err)
		rc.log.Warn("Connecting to remote cluster failed; retrying", "error", err, "attempt", attempt)
		retry.Sleep(ctx, min(time.Second<<min(attempt, 4), 10*time.Second))
	}
}

// watchdog probes the remote etcd and withdraws the cluster's identities
// when it has not answered for the timeout: a watch on an unreachable
// server reports nothing, so only a request tells. When the cluster answers
// again, a new listing brings the identities back.
func (rc *remoteCluster) watchdog(ctx context.Context) {
	every := min(max(rc.timeout/4, 100*time.Millisecond), 10*time.Second)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		err := rc.probe(ctx, every)
		if ctx.Err() != nil {
			return
		}
		rc.mu.Lock()
		if err == nil {
			rc.connected, rc.lastOK, rc.lastErr = true, time.Now(), ""
			relist := rc.withdrawn
			rc.mu.Unlock()
			if relist {
				rc.log.Info("Remote cluster reachable again; listing its identities")
				rc.cache.Relist()
			}
			continue
		}
		rc.connected, rc.lastErr = false, err.Error()
		expired := !rc.withdrawn && time.Since(rc.lastOK) > rc.timeout
		if expired {
			rc.withdrawn = true
		}
		rc.mu.Unlock()
		if expired {
			rc.log.Warn("Remote cluster unreachable for longer than --clustermesh-remote-timeout; withdrawing its identities",
				"timeout", rc.timeout, "error", err)
			rc.cache.Clear()
		}
	}
}

func (rc *remoteCluster) probe(ctx context.Context, timeout time.Duration) error {
	cli := rc.Client()
	if cli == nil {
		rc.mu.Lock()
		defer rc.mu.Unlock()
		if rc.lastErr != "" {
			return errors.New(rc.lastErr)
		}
		return errors.New("not connected")
	}
	pctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(ctx), max(timeout, time.Second))
	defer cancel()
	_, err := cli.Get(pctx, etcdstore.MasterKeyPrefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	return err
}

func (rc *remoteCluster) status() RemoteClusterStatus {
	cached, rejected := rc.cache.Counts()
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return RemoteClusterStatus{
		Name:          rc.name,
		ClusterID:     rc.info.ID,
		Endpoints:     rc.cfg.Endpoints,
		Connected:     rc.connected,
		Synced:        rc.cache.Synced() && !rc.withdrawn,
		Identities:    cached,
		Rejected:      rejected,
		RejectedTotal: rc.cache.RejectedTotal(),
		LastError:     rc.lastErr,
	}
}
