package checkpoint_test

import (
	"errors"
	"fmt"
	"log"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/identityd/identityd/cells/checkpoint"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// ciliumFile is a checkpoint as Cilium v1.16 writes it: one node-local and
// one remote-node identity.
const ciliumFile = `[{"id":16777217,"labels":{"10.0.0.0/8":{"key":"10.0.0.0/8","source":"cidr"},"world":{"key":"world","source":"reserved"}}},{"id":33554433,"labels":{"192.168.1.10/32":{"key":"192.168.1.10/32","source":"cidr"},"remote-node":{"key":"remote-node","source":"reserved"}}}]`

// stateDir returns a new directory of mode 0700, like the agent's state
// directory.
func stateDir() string {
	dir, err := os.MkdirTemp("", "identityd-state")
	if err != nil {
		log.Fatal(err)
	}
	return dir
}

// Restoration reads the checkpoint that an earlier run (of identityd or of
// a Cilium agent) left in the state directory.
func ExampleLoader_Load() {
	dir := stateDir()
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, checkpoint.FileName)
	if err := os.WriteFile(path, []byte(ciliumFile), 0o600); err != nil {
		log.Fatal(err)
	}

	res, err := checkpoint.Loader{}.Load(path)
	if err != nil {
		// A bad file that could not be kept aside: it must not be
		// overwritten, so the agent does not write a checkpoint.
		log.Fatal(err)
	}
	for _, id := range res.Identities {
		fmt.Println(id.ID, id.ID.Scope(), id.Labels)
	}
	fmt.Println("found:", res.Report.Found, "valid:", res.Report.Valid)
	// Output:
	// 16777217 local cidr:10.0.0.0/8,reserved:world
	// 33554433 remote-node cidr:192.168.1.10/32,reserved:remote-node
	// found: true valid: 2
}

// An entry that is JSON but no restorable identity is skipped and the
// others are restored; the loader keeps a copy of the file, since the next
// checkpoint will no longer hold that entry.
func ExampleLoader_Load_invalidEntry() {
	dir := stateDir()
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, checkpoint.FileName)
	file := `[{"id":16777217,"labels":{"10.0.0.0/8":"cidr:10.0.0.0/8","world":"reserved:world"}},
		{"id":256,"labels":{"app":"k8s:app=web"}}]`
	if err := os.WriteFile(path, []byte(file), 0o600); err != nil {
		log.Fatal(err)
	}

	// Now names the copy; it is fixed here only to give a stable output.
	loader := checkpoint.Loader{Now: func() time.Time { return time.Unix(1700000000, 0) }}
	res, err := loader.Load(path)
	if err != nil {
		log.Fatal(err)
	}
	for _, id := range res.Identities {
		fmt.Println("restored:", id.ID, id.Labels)
	}
	for _, bad := range res.Report.Invalid {
		fmt.Println("skipped:", bad)
	}
	fmt.Println("copy kept as", filepath.Base(res.Report.SetAside))
	// Output:
	// restored: 16777217 cidr:10.0.0.0/8,reserved:world
	// skipped: entry 1 (id 256): id is not in a local scope: 256 (scope global)
	// copy kept as local_allocator_state.json.invalid-1700000000
}

// A file that is not a checkpoint, here one cut short, is moved aside (never
// deleted) and the agent starts without restoration.
func ExampleLoader_Load_corrupt() {
	dir := stateDir()
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, checkpoint.FileName)
	if err := os.WriteFile(path, []byte(`[{"id":16777217,"labels":{`), 0o600); err != nil {
		log.Fatal(err)
	}

	loader := checkpoint.Loader{Now: func() time.Time { return time.Unix(1700000000, 0) }}
	res, err := loader.Load(path)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(res.Report.Corrupt)
	fmt.Println("restored:", len(res.Identities))
	fmt.Println("moved to", filepath.Base(res.Report.SetAside))
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		fmt.Println("no file left at", filepath.Base(path))
	}
	// Output:
	// corrupt checkpoint: expected object key at offset 26
	// restored: 0
	// moved to local_allocator_state.json.corrupt-1700000000
	// no file left at local_allocator_state.json
}

// Decode reads a checkpoint that is already in memory. Every syntax error
// wraps ErrCorrupt and says where the text stopped being JSON.
func ExampleDecode() {
	ids, invalid, err := checkpoint.Decode([]byte(ciliumFile))
	fmt.Println(len(ids), len(invalid), err)

	_, _, err = checkpoint.Decode([]byte(`[{"id":16777217 "labels":{}}]`))
	var syntax *checkpoint.SyntaxError
	if errors.Is(err, checkpoint.ErrCorrupt) && errors.As(err, &syntax) {
		fmt.Println("offset", syntax.Offset, "-", syntax.Msg)
	}
	// Output:
	// 2 0 <nil>
	// offset 16 - expected ',' or '}' in object
}

// Writing a checkpoint: AppendJSON encodes the local identities in ID order
// (global ones live in the kvstore and are left out), and WriteFile
// replaces the file atomically and durably, with mode 0600.
func ExampleWriteFile() {
	dir := stateDir()
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, checkpoint.FileName)

	ids := []*identity.Identity{
		{ID: 16777218, Labels: labels.FromPrefix(netip.MustParsePrefix("10.1.0.0/16"), false)},
		{ID: 256, Labels: labels.MustParse("k8s:app=web")},
		{ID: 16777217, Labels: labels.FromPrefix(netip.MustParsePrefix("10.0.0.0/8"), false)},
	}
	if err := checkpoint.WriteFile(path, checkpoint.AppendJSON(nil, ids)); err != nil {
		log.Fatal(err)
	}

	fi, err := os.Stat(path)
	if err != nil {
		log.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(fi.Mode().Perm())
	fmt.Print(string(data))
	// Output:
	// -rw-------
	// [{"id":16777217,"labels":{"10.0.0.0/8":{"key":"10.0.0.0/8","source":"cidr"},"world":{"key":"world","source":"reserved"}}},{"id":16777218,"labels":{"10.1.0.0/16":{"key":"10.1.0.0/16","source":"cidr"},"world":{"key":"world","source":"reserved"}}}]
}
