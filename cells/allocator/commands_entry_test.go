package allocator_test

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"testing"

	"github.com/identityd/identityd/internal/eventually"

	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/script"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/allocatortest"
	"github.com/identityd/identityd/labels"
)

// TestCommandEntriesMatchList checks that identity/get and
// identity/allocate, which look one identity up, show the source and
// reference count that identity/list shows for it: reserved, local,
// restored, remote-node scope, global held here and global held by
// another node only.
func TestCommandEntriesMatchList(t *testing.T) {
	store := allocatortest.NewStore(identity.ClusterInfo{Name: "default"})
	a, h, err := node(t, store.NewBackend("node1"), nil)
	if err != nil {
		t.Fatal(err)
	}
	other, _, err := node(t, store.NewBackend("node2"), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	alloc := func(a allocator.Allocator, s string, opts ...allocator.AllocateOption) *identity.Identity {
		t.Helper()
		id, _, err := a.Allocate(ctx, labels.MustParse(strings.Fields(s)...), opts...)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	alloc(a, "cidr:10.0.0.0/8")
	alloc(a, "cidr:10.0.0.0/8")
	alloc(a, "cidr:10.1.0.0/16", allocator.AsRestored())
	alloc(a, "cidr:192.168.1.10/32 reserved:remote-node")
	alloc(a, "k8s:app=held")
	elsewhere := alloc(other, "k8s:app=elsewhere")
	eventually.True(t, "node1 sees node2's identity", func() bool { return a.LookupByID(elsewhere.ID) != nil })

	cmds, err := h.ScriptCommands(hivetest.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	e := script.Engine{Cmds: cmds}
	s, err := script.NewState(ctx, t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	show := func(line string) allocator.Entry {
		t.Helper()
		if err := e.ExecuteLine(s, line, io.Discard); err != nil {
			t.Fatalf("%s: %v", line, err)
		}
		var out []allocator.Entry
		if err := json.Unmarshal([]byte(s.Stdout()), &out); err != nil || len(out) != 1 {
			t.Fatalf("%s: %q: %v", line, s.Stdout(), err)
		}
		return out[0]
	}
	same := func(line string, got, want allocator.Entry) {
		t.Helper()
		if got.Identity.ID != want.Identity.ID || !got.Identity.Labels.Equal(want.Identity.Labels) || got.Source != want.Source || got.RefCount != want.RefCount {
			t.Errorf("%s: %v %s %d refs, identity/list has %v %s %d refs", line,
				got.Identity, got.Source, got.RefCount, want.Identity, want.Source, want.RefCount)
		}
	}
	sources := map[allocator.Source]bool{}
	for _, want := range a.List() {
		sources[want.Source] = true
		for _, line := range []string{
			fmt.Sprintf("identity/get -o json %d", want.Identity.ID),
			"identity/get -o json " + strings.Join(want.Identity.Labels.Strings(), " "),
		} {
			same(line, show(line), want)
		}
	}
	for _, src := range []allocator.Source{allocator.SourceReserved, allocator.SourceLocal, allocator.SourceRestored, allocator.SourceGlobal} {
		if !sources[src] {
			t.Errorf("no %s identity was compared", src)
		}
	}
	// identity/allocate shows the reference it took.
	line := "identity/allocate -o json cidr:10.0.0.0/8"
	got := show(line)
	for _, want := range a.List() {
		if want.Identity.ID == got.Identity.ID {
			same(line, got, want)
			if want.RefCount != 3 {
				t.Errorf("%s: %d refs after three allocations", line, want.RefCount)
			}
		}
	}
}
