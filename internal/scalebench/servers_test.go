package scalebench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"
	"k8s.io/client-go/rest"

	"github.com/identityd/identityd/cells/allocator/crdstore"
	"github.com/identityd/identityd/cells/allocator/etcdstore"
	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/k8stest"
)

const (
	modeEtcd = "etcd"
	modeCRD  = "crd"
)

// The classes of what reaches a server.
const (
	// classRefs is the maintenance of references and the garbage
	// collection: what the design of the collection decides.
	classRefs = "refs+GC"
	// classEvents is the identity events every node must see: new and
	// deleted identities, and their watch events.
	classEvents = "events"
	// classOther is the rest (connection checks, CRD registration).
	classOther = "other"
)

var classes = []string{classRefs, classEvents, classOther}

// kindRow is what one kind of request, or the watch events of one resource,
// cost at the server in a window.
type kindRow struct {
	kind, class string
	// gc marks kinds that are a collection run's own work (listings,
	// marks, deletes): the per-run unit of the extrapolation.
	gc       bool
	requests float64
	events   float64
	// sent and recv are bytes; NaN when the server does not count them
	// by kind. sentEst marks sent bytes that are an estimate.
	sent, recv float64
	sentEst    bool
}

// cost is a quantity of each measure.
type cost struct{ requests, events, sent, recv float64 }

func (c cost) plus(o cost) cost {
	return cost{c.requests + o.requests, c.events + o.events, c.sent + o.sent, c.recv + o.recv}
}

func (c cost) minus(o cost) cost {
	return cost{c.requests - o.requests, c.events - o.events, c.sent - o.sent, c.recv - o.recv}
}

func (c cost) times(f float64) cost {
	return cost{c.requests * f, c.events * f, c.sent * f, c.recv * f}
}

// server is the store's server in one mode, and how its counters are read.
type server interface {
	describe() string
	scrape(ctx context.Context) (snapshot, error)
	startNode(ctx context.Context, log *slog.Logger, i int, cfg config) (*node, error)
	// attribute turns a window's counter deltas into rows by kind and
	// the costs by class.
	attribute(w *window)
	// gcCost is the part of the window's refs+GC cost that the
	// collection's runs made.
	gcCost(w *window) cost
	// renewals counts the per-node renewals the window's deltas show.
	renewals(d snapshot) float64
	// afterSteady and afterChurn run once each window has been scraped,
	// for measurements that must not fall into a window.
	afterSteady(ctx context.Context) error
	afterChurn(ctx context.Context) error
	// pids are the server processes, for their peak memory.
	pids() map[string]int
	bytesNote() string
}

// etcdServer is the etcd of the identities, one member, started as a
// process. Its /metrics counts gRPC requests and stream messages by
// method, watch events, and bytes sent and received in total.
type etcdServer struct {
	c     *etcdtest.Cluster
	cli   *clientv3.Client
	url   string
	http  *http.Client
	nodes int
	// listing is the cost of one collection run's listing of the
	// reference keys, replayed after the steady window.
	listing cost
	// putEvent, deleteEvent and watchResponse are the encoded sizes of a
	// master key's watch events and of a watch response's own fields.
	putEvent, deleteEvent, watchResponse float64
}

func startEtcd(tb testing.TB, nodes int) *etcdServer {
	c := etcdtest.StartSingle(tb, etcdtest.WithUnsafeNoFsync())
	return &etcdServer{
		c:     c,
		nodes: nodes,
		cli:   c.Client(tb),
		url:   c.Endpoints()[0] + "/metrics",
		http:  &http.Client{Timeout: 30 * time.Second},
	}
}

func (s *etcdServer) describe() string {
	return "identity etcd at " + s.c.Endpoints()[0] + " (one member, fsync off)"
}

func (s *etcdServer) scrape(ctx context.Context) (snapshot, error) {
	return scrape(ctx, s.http, s.url)
}

func (s *etcdServer) startNode(ctx context.Context, log *slog.Logger, i int, cfg config) (*node, error) {
	return startEtcdNode(ctx, log, s.c.Endpoints(), i, cfg)
}

func (s *etcdServer) pids() map[string]int {
	return map[string]int{"etcd": s.c.Member(0).PID()}
}

// etcdClass is the class of a gRPC method: every KV and lease request is
// the maintenance of references or the collection (the create of a new
// identity writes its master key in the transaction of its reference);
// the watch is the identities' events.
func etcdClass(service, method string) string {
	switch {
	case method == "Watch":
		return classEvents
	case strings.HasSuffix(service, ".KV"), strings.HasSuffix(service, ".Lease"), strings.HasPrefix(service, "v3lock"), strings.HasPrefix(service, "v3election"):
		return classRefs
	}
	return classOther
}

func (s *etcdServer) attribute(w *window) {
	d := w.delta
	byMethod := map[string]*kindRow{}
	for _, x := range d {
		if x.name != "grpc_server_msg_received_total" || x.value == 0 {
			continue
		}
		m := x.labels["grpc_method"]
		r := byMethod[m]
		if r == nil {
			r = &kindRow{kind: m, class: etcdClass(x.labels["grpc_service"], m), sent: math.NaN(), recv: math.NaN()}
			byMethod[m] = r
		}
		r.requests += x.value
	}
	for _, r := range byMethod {
		if r.kind == "Watch" {
			r.kind = "Watch (stream messages)"
		}
		w.rows = append(w.rows, *r)
	}
	// Watch events: only the master-key cache watches this etcd.
	events := d.sum("etcd_debugging_mvcc_events_total", nil)
	responses := d.sum("grpc_server_msg_sent_total", labelIs("grpc_method", "Watch"))
	deletes := float64(w.gc.deleted) * float64(s.nodes)
	watchBytes := responses*s.watchResponse + max(events-deletes, 0)*s.putEvent + min(deletes, events)*s.deleteEvent
	w.rows = append(w.rows, kindRow{kind: "watch events", class: classEvents, events: events, sent: watchBytes, recv: 0, sentEst: true})
	w.sent = d.sum("etcd_network_client_grpc_sent_bytes_total", nil)
	w.recv = d.sum("etcd_network_client_grpc_received_bytes_total", nil)
	w.byClass = map[string]cost{}
	for _, r := range w.rows {
		c := w.byClass[r.class]
		c.requests += r.requests
		c.events += r.events
		w.byClass[r.class] = c
	}
	// etcd counts bytes only in total: the watch's are the estimate above,
	// the rest is the requests', nearly all of them refs+GC.
	ev := w.byClass[classEvents]
	ev.sent, ev.recv = watchBytes, 0
	w.byClass[classEvents] = ev
	refs := w.byClass[classRefs]
	refs.sent, refs.recv = max(w.sent-watchBytes, 0), w.recv
	w.byClass[classRefs] = refs
	w.sentEst = map[string]bool{classRefs: true, classEvents: true}
}

func (s *etcdServer) bytesNote() string {
	return "etcd counts bytes sent and received only in total (encoded gRPC messages): watch-event bytes are estimated from the encoded size of a master key's event, the rest is counted as refs+GC"
}

// gcCost: a run lists the reference keys (the replayed listing) and sends
// one transaction per candidate.
func (s *etcdServer) gcCost(w *window) cost {
	c := s.listing.times(float64(w.gc.runs))
	c.requests += float64(w.gc.deleted + w.gc.skipped)
	return c
}

func (s *etcdServer) renewals(d snapshot) float64 {
	return d.sum("grpc_server_msg_received_total", labelIs("grpc_method", "LeaseKeepAlive"))
}

// afterSteady replays a collection run's listing of the reference keys (the
// store's listing: keys only, pages of 1000 at the first page's revision)
// and records its encoded request and response sizes, which are what the
// server's byte counters count.
func (s *etcdServer) afterSteady(ctx context.Context) error {
	prefix := etcdstore.ReferenceKeyPrefix
	end := []byte(clientv3.GetPrefixRangeEnd(prefix))
	from, rev := []byte(prefix), int64(0)
	var c cost
	kv := pb.NewKVClient(s.cli.ActiveConnection())
	for {
		req := &pb.RangeRequest{Key: from, RangeEnd: end, Limit: 1000, KeysOnly: true, Revision: rev}
		resp, err := kv.Range(ctx, req)
		if err != nil {
			return fmt.Errorf("replaying the collection's listing: %w", err)
		}
		c.requests++
		c.recv += float64(proto.Size(req))
		c.sent += float64(proto.Size(resp))
		if rev == 0 {
			rev = resp.Header.Revision
		}
		if !resp.More || len(resp.Kvs) == 0 {
			break
		}
		from = append(resp.Kvs[len(resp.Kvs)-1].Key, 0)
	}
	s.listing = c
	return nil
}

// afterChurn measures the encoded sizes of a master key's watch events.
func (s *etcdServer) afterChurn(ctx context.Context) error {
	resp, err := s.cli.Get(ctx, etcdstore.MasterKeyPrefix, clientv3.WithPrefix(), clientv3.WithLimit(1))
	if err != nil {
		return err
	}
	if len(resp.Kvs) == 0 {
		return fmt.Errorf("no master key under %s", etcdstore.MasterKeyPrefix)
	}
	kv := resp.Kvs[0]
	hdr := (*pb.RangeResponse)(resp).Header
	empty := &pb.WatchResponse{Header: hdr, WatchId: 1}
	base := proto.Size(empty)
	put := &pb.WatchResponse{Header: hdr, WatchId: 1, Events: []*mvccpb.Event{{Type: mvccpb.Event_PUT, Kv: kv}}}
	del := &pb.WatchResponse{Header: hdr, WatchId: 1, Events: []*mvccpb.Event{{Type: mvccpb.Event_DELETE, Kv: &mvccpb.KeyValue{Key: kv.Key, ModRevision: kv.ModRevision}}}}
	s.watchResponse = float64(base)
	s.putEvent = float64(proto.Size(put) - base)
	s.deleteEvent = float64(proto.Size(del) - base)
	return nil
}

// crdServer is a Kubernetes API server (kube-apiserver of internal/k8stest, its own
// etcd, which is not counted: nodes never talk to it). Its /metrics counts
// requests by verb and resource, response sizes, request body sizes and
// watch events and their sizes by resource.
type crdServer struct {
	srv  *k8stest.Server
	http *http.Client
	// bodies is the request body size histogram's name, when the server
	// has one.
	bodies string
	// object is the encoded size of an object of each resource, read
	// after the churn window: the estimate of a write's response, whose
	// size the server does not count.
	object map[string]float64
}

func startCRD(ctx context.Context, tb testing.TB) (*crdServer, error) {
	srv := k8stest.Start(tb)
	cli, err := rest.HTTPClientFor(srv.RESTConfig())
	if err != nil {
		return nil, err
	}
	// The store's own registration, as every node runs it at start,
	// once before the nodes; then past the server's delay of creates on
	// a CRD established less than 2s ago.
	if err := crdstore.RegisterCRDs(ctx, srv.RESTConfig()); err != nil {
		return nil, err
	}
	time.Sleep(2100 * time.Millisecond)
	s := &crdServer{srv: srv, http: cli}
	snap, err := s.scrape(ctx)
	if err != nil {
		return nil, err
	}
	for _, name := range []string{"apiserver_request_body_size_bytes_sum", "apiserver_request_body_sizes_sum"} {
		if snap.has(name) {
			s.bodies = name
		}
	}
	return s, nil
}

func (s *crdServer) describe() string {
	return "API server at " + s.srv.URL() + " (kube-apiserver; its own etcd, fsync off, is not counted)"
}

// scrape reads the server's /metrics and adds the nodes' count of the
// answers to their writes (writeAnswers).
func (s *crdServer) scrape(ctx context.Context) (snapshot, error) {
	answers := writeAnswerBytes()
	snap, err := scrape(ctx, s.http, s.srv.URL()+"/metrics")
	if err != nil {
		return nil, err
	}
	maps.Copy(snap, answers)
	return snap, nil
}

func (s *crdServer) startNode(ctx context.Context, log *slog.Logger, i int, cfg config) (*node, error) {
	return startCRDNode(ctx, log, s.srv.RESTConfig(), i, cfg)
}

func (s *crdServer) pids() map[string]int {
	out := map[string]int{}
	if c := s.srv.EtcdCluster(); c != nil {
		out["its etcd"] = c.Member(0).PID()
	}
	if u, err := url.Parse(s.srv.URL()); err == nil {
		if pid := pidWithArgs("--secure-port", u.Port()); pid > 0 {
			out["API server"] = pid
		}
	}
	return out
}

// crdClass is the class of a request: everything of IdentityNode and
// IdentityLease objects, and the collection's listings, marks and deletes
// of CiliumIdentity objects, is refs+GC; creates and reads of
// CiliumIdentity objects and their watch are events.
func crdClass(verb, resource string) (class string, gc bool) {
	switch resource {
	case "identitynodes":
		return classRefs, verb == "LIST" || verb == "DELETE"
	case "identityleases":
		return classRefs, false
	case "ciliumidentities":
		switch verb {
		case "LIST", "PATCH", "DELETE", "DELETECOLLECTION", "PUT", "UPDATE":
			return classRefs, true
		}
		return classEvents, false
	}
	return classOther, false
}

func (s *crdServer) attribute(w *window) {
	d := w.delta
	type key struct{ verb, resource string }
	rows := map[key]*kindRow{}
	row := func(verb, resource string) *kindRow {
		k := key{verb, resource}
		if r := rows[k]; r != nil {
			return r
		}
		class, gc := crdClass(verb, resource)
		r := &kindRow{kind: verb + " " + resource, class: class, gc: gc}
		if s.bodies == "" {
			r.recv = math.NaN()
		}
		rows[k] = r
		return r
	}
	counted := map[key]bool{}
	for _, x := range d {
		if x.value == 0 {
			continue
		}
		verb, res := x.labels["verb"], x.labels["resource"]
		if x.labels["subresource"] != "" {
			res += "/" + x.labels["subresource"]
		}
		if x.name == s.bodies {
			verb = bodyVerbs[verb]
		}
		switch x.name {
		case "apiserver_request_total":
			row(verb, res).requests += x.value
		case "apiserver_response_sizes_sum":
			row(verb, res).sent += x.value
		case s.bodies:
			row(verb, res).recv += x.value
		case "apiserver_watch_events_total":
			r := row("watch events", res)
			r.class, r.gc = crdClass("WATCH", res)
			r.events += x.value
		case "apiserver_watch_events_sizes_sum":
			r := row("watch events", res)
			r.class, r.gc = crdClass("WATCH", res)
			r.sent += x.value
		case writeAnswerSeries:
			row(verb, res).sent += x.value
			counted[key{verb, res}] = true
		}
	}
	// The server counts the response sizes of reads only. The nodes
	// count the answers to their writes; in runs saved before they did,
	// a write's answer is estimated as the object written (or deleted).
	for k, r := range rows {
		if size, ok := s.object[k.resource]; ok && writeVerbs[k.verb] && !counted[k] {
			r.sent += r.requests * size
			r.sentEst = true
		}
	}
	w.byClass = map[string]cost{}
	w.sentEst = map[string]bool{}
	for _, r := range rows {
		w.rows = append(w.rows, *r)
		if r.sentEst {
			w.sentEst[r.class] = true
			w.sentEst["all"] = true
		}
		c := w.byClass[r.class]
		recv := r.recv
		if math.IsNaN(recv) {
			recv = 0
		}
		w.byClass[r.class] = c.plus(cost{r.requests, r.events, r.sent, recv})
		w.sent += r.sent
		w.recv += recv
	}
	if s.bodies == "" {
		w.recv = math.NaN()
	}
}

// bodyVerbs maps the request body histogram's verbs to the request
// counter's.
var bodyVerbs = map[string]string{
	"create": "POST", "patch": "PATCH", "update": "PUT", "delete": "DELETE", "delete_collection": "DELETECOLLECTION",
}

var writeVerbs = map[string]bool{"POST": true, "PATCH": true, "PUT": true, "DELETE": true, "APPLY": true}

func (s *crdServer) bytesNote() string {
	note := "bytes are the API server's own sums: response sizes of reads (GET, LIST) by verb and resource, watch event sizes by resource"
	if s.bodies != "" {
		note += ", request body sizes by verb and resource (" + strings.TrimSuffix(s.bodies, "_sum") + ")"
	} else {
		note += "; the server counts no request body sizes (received bytes not shown)"
	}
	return note + "; the server counts no response sizes of writes: the nodes count the bodies of the answers to theirs as they read them (in runs saved before they did, \"~\" marks an estimate, the writes times the size of an object of the resource as a GET returns it). HTTP headers, TLS and HTTP/2 framing are not counted. ciliumidentities watch events include the MODIFIED events of the collection's marks (the counter has no event type)"
}

func (s *crdServer) gcCost(w *window) cost {
	var c cost
	for _, r := range w.rows {
		if r.gc {
			recv := r.recv
			if math.IsNaN(recv) {
				recv = 0
			}
			c = c.plus(cost{r.requests, r.events, r.sent, recv})
		}
	}
	return c
}

func (s *crdServer) renewals(d snapshot) float64 {
	return d.sum("apiserver_request_total", func(l map[string]string) bool {
		return l["verb"] == "PATCH" && l["resource"] == "identitynodes"
	})
}

func (s *crdServer) afterSteady(context.Context) error { return nil }

// afterChurn reads an object of each resource the nodes write, for the
// estimate of the writes' responses.
func (s *crdServer) afterChurn(ctx context.Context) error {
	s.object = map[string]float64{}
	for _, res := range []struct{ group, version, resource string }{
		{crdstore.CiliumGroup, crdstore.CiliumVersion, "ciliumidentities"},
		{crdstore.IdentityGroup, crdstore.IdentityVersion, "identitynodes"},
	} {
		base := s.srv.URL() + "/apis/" + res.group + "/" + res.version + "/" + res.resource
		list, err := s.get(ctx, base+"?limit=1")
		if err != nil {
			return err
		}
		var names struct {
			Items []struct {
				Metadata struct{ Name string } `json:"metadata"`
			} `json:"items"`
		}
		if err := json.Unmarshal(list, &names); err != nil || len(names.Items) == 0 {
			return fmt.Errorf("no %s to read (%v)", res.resource, err)
		}
		obj, err := s.get(ctx, base+"/"+names.Items[0].Metadata.Name)
		if err != nil {
			return err
		}
		s.object[res.resource] = float64(len(obj))
	}
	return nil
}

func (s *crdServer) get(ctx context.Context, url string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "application/json")
	resp, err := s.http.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return b, err
}

// pidWithArgs finds the process whose command line has flag followed by
// value, or 0.
func pidWithArgs(flag, value string) int {
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(d, "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(b), "\x00")
		for i := 0; i+1 < len(args); i++ {
			if args[i] == flag && args[i+1] == value {
				pid, _ := strconv.Atoi(filepath.Base(d))
				return pid
			}
		}
	}
	return 0
}

// peakRSS is the peak resident memory of process pid ("self" for this
// one), from /proc, in bytes.
func peakRSS(pid string) float64 {
	b, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		return math.NaN()
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			f := strings.Fields(v)
			if len(f) > 0 {
				kb, _ := strconv.ParseFloat(f[0], 64)
				return kb * 1024
			}
		}
	}
	return math.NaN()
}

// resetPeakRSS starts this process's peak resident memory afresh.
func resetPeakRSS() {
	os.WriteFile("/proc/self/clear_refs", []byte("5"), 0)
}
