package crdstore

import (
	"testing"
	"time"

	"github.com/cilium/hive/hivetest"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/idprobe"
	"github.com/identityd/identityd/labels"
)

type recordedEvents struct {
	upserts, deletes map[identity.NumericIdentity]string
	synced           int
}

func newRecordedEvents() *recordedEvents {
	return &recordedEvents{upserts: map[identity.NumericIdentity]string{}, deletes: map[identity.NumericIdentity]string{}}
}

func (r *recordedEvents) emit(cs []change) {
	for _, c := range cs {
		if c.upsert {
			r.upserts[c.id] = c.lbls.Canonical()
		} else {
			r.deletes[c.id] = c.lbls.Canonical()
		}
	}
}

func object(id identity.NumericIdentity, lbls labels.Labels, created time.Time) *CiliumIdentity {
	return &CiliumIdentity{
		ObjectMeta:     metav1.ObjectMeta{Name: id.String(), ResourceVersion: "1", CreationTimestamp: metav1.NewTime(created)},
		SecurityLabels: securityLabels(lbls),
	}
}

func TestCacheIgnoresMalformedObjects(t *testing.T) {
	ev := newRecordedEvents()
	c := newIdentityCache(hivetest.Logger(t), identity.ClusterInfo{Name: "default"}, cacheHooks{emit: ev.emit, synced: func() { ev.synced++ }})
	good := labels.MustParse("k8s:app=web")
	bad := []*CiliumIdentity{
		{ObjectMeta: metav1.ObjectMeta{Name: "web", ResourceVersion: "2"}, SecurityLabels: securityLabels(good)},
		{ObjectMeta: metav1.ObjectMeta{Name: "70000", ResourceVersion: "3"}, SecurityLabels: securityLabels(good)},
		{ObjectMeta: metav1.ObjectMeta{Name: "300", ResourceVersion: "4"}, SecurityLabels: map[string]string{"nosource": "x"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "301", ResourceVersion: "5"}, SecurityLabels: map[string]string{"k8s:a": "b;c"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "0300", ResourceVersion: "6"}, SecurityLabels: securityLabels(good)},
	}
	list := []any{object(1000, good, time.Now())}
	for _, b := range bad {
		list = append(list, b)
	}
	if err := c.Replace(list, "10"); err != nil {
		t.Fatal(err)
	}
	if got := c.ignoredTotal.Load(); got != uint64(len(bad)) {
		t.Errorf("ignored %d objects, want %d", got, len(bad))
	}
	if len(ev.upserts) != 1 || ev.synced != 1 {
		t.Errorf("upserts %v, synced %d", ev.upserts, ev.synced)
	}
	// The same versions again are not counted again; a valid object
	// turning invalid leaves the cache.
	if err := c.Replace(list, "11"); err != nil {
		t.Fatal(err)
	}
	broken := object(1000, good, time.Now())
	broken.ResourceVersion = "12"
	broken.SecurityLabels = map[string]string{"k8s:x": "\x01"}
	if err := c.Update(broken); err != nil {
		t.Fatal(err)
	}
	if got := c.ignoredTotal.Load(); got != uint64(len(bad))+1 {
		t.Errorf("ignored %d, want %d", got, len(bad)+1)
	}
	if _, ok := ev.deletes[1000]; !ok || c.get(1000) != nil || ev.synced != 1 {
		t.Errorf("the object that turned invalid is still cached (deletes %v, synced %d)", ev.deletes, ev.synced)
	}
}

// TestCacheLookupRule checks the design's rule for a label set with several
// objects: the earliest creation second, an object near the start of the
// set's probe sequence counting walkHeadStart earlier; of the same rank,
// the one earliest on the sequence. The cache settles the pick alone when
// it shows the walk's first object of the set, or when the pick is older
// than its lag.
func TestCacheLookupRule(t *testing.T) {
	cluster := identity.ClusterInfo{Name: "default"}
	l := labels.MustParse("k8s:app=web")
	p := idprobe.New(l.Canonical(), cluster)
	other := func(i int) labels.Labels { return labels.MustParse("k8s:other=" + string(rune('a'+i))) }
	now := time.Now().Truncate(time.Second)
	c := newIdentityCache(hivetest.Logger(t), cluster, cacheHooks{})
	pick := func(want identity.NumericIdentity, settled bool, why string) {
		t.Helper()
		e, ok := c.pickSettled(l.Canonical(), now)
		if e == nil || e.id != want || ok != settled {
			t.Fatalf("%s: pick = %v (settled %v), want %d (settled %v)", why, e, ok, want, settled)
		}
		if e := c.lookup(l.Canonical()); e == nil || e.id != want {
			t.Fatalf("%s: lookup = %v, want %d", why, e, want)
		}
	}
	// Slots 0 and 1 held by others, slot 2 by l; far slots by l, off the
	// sequence.
	far, farther := p.Slot(1000), p.Slot(2000)
	objs := []any{
		object(p.Slot(0), other(0), now),
		object(p.Slot(1), other(1), now),
		object(far, l, now.Add(-walkHeadStart+time.Second)),
	}
	if err := c.Replace(objs, "1"); err != nil {
		t.Fatal(err)
	}
	// Young, off the sequence, and no object of l on the walk: a node
	// must look at the walk's slot at the server before it adopts it.
	pick(far, false, "one young object off the sequence")
	// The walk's object, created walkHeadStart-1s after the far one,
	// wins, and the cache shows everything visible before it.
	if err := c.Update(object(p.Slot(2), l, now)); err != nil {
		t.Fatal(err)
	}
	pick(p.Slot(2), true, "the walk's object created within the head start")
	if c.splitKeys.Load() != 1 || c.splitsTotal.Load() != 1 {
		t.Errorf("split counts %d/%d, want 1/1", c.splitKeys.Load(), c.splitsTotal.Load())
	}
	// Off the sequence, older than the head start: the far one.
	if err := c.Update(object(far, l, now.Add(-walkHeadStart-time.Second))); err != nil {
		t.Fatal(err)
	}
	pick(far, true, "an object off the sequence older than the head start")
	// Two off the sequence of the same second, and no walk object: the
	// one earlier on the sequence; settled only once older than the
	// cache's lag.
	if err := c.Delete(objs[1]); err != nil {
		t.Fatal(err)
	}
	if err := c.Update(object(farther, l, now.Add(-walkHeadStart-time.Second))); err != nil {
		t.Fatal(err)
	}
	if err := c.Delete(object(p.Slot(2), l, now)); err != nil {
		t.Fatal(err)
	}
	pick(far, false, "two young objects off the sequence")
	for _, id := range []identity.NumericIdentity{far, farther} {
		if err := c.Update(object(id, l, now.Add(-maxCacheLag-2*time.Second))); err != nil {
			t.Fatal(err)
		}
	}
	pick(far, true, "two old objects off the sequence")
}
