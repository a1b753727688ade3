package checkpoint

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// formatsExample is the example of FORMATS.md §4, as Cilium v1.16 writes it.
const formatsExample = `[{"id":16777217,"labels":{"10.0.0.0/8":{"key":"10.0.0.0/8","source":"cidr"},"world":{"key":"world","source":"reserved"}}},{"id":33554433,"labels":{"192.168.1.10/32":{"key":"192.168.1.10/32","source":"cidr"},"remote-node":{"key":"remote-node","source":"reserved"}}}]` + "\n"

func exampleIdentities() []*identity.Identity {
	return []*identity.Identity{
		{ID: 16777217, Labels: labels.FromPrefix(mustPrefix("10.0.0.0/8"), false)},
		{ID: 33554433, Labels: labels.MustNew(labels.Label{Source: "cidr", Key: "192.168.1.10/32"}, labels.LabelRemoteNode)},
	}
}

func TestEncodeFormatsExample(t *testing.T) {
	// Given in reverse order, with a global identity that must be left out.
	ids := exampleIdentities()
	in := []*identity.Identity{ids[1], {ID: 256, Labels: labels.MustParse("k8s:app=web")}, ids[0], nil}
	got := AppendJSON(nil, in)
	if string(got) != formatsExample {
		t.Fatalf("got  %s\nwant %s", got, formatsExample)
	}
	if again := AppendJSON(nil, in); !bytes.Equal(again, got) {
		t.Fatal("two encodings of the same state differ")
	}
	if !json.Valid(got) {
		t.Fatal("not valid JSON")
	}
}

func TestEncodeEmpty(t *testing.T) {
	if got := string(AppendJSON(nil, nil)); got != "[]\n" {
		t.Fatalf("got %q", got)
	}
}

func TestDecodeFormatsExample(t *testing.T) {
	ids, invalid, err := Decode([]byte(formatsExample))
	if err != nil || len(invalid) != 0 {
		t.Fatal(err, invalid)
	}
	if got, want := describe(ids), describe(values(exampleIdentities())); got != want {
		t.Fatalf("got\n%swant\n%s", got, want)
	}
}

// TestDecodeCiliumStyle reads a file as another writer may produce it:
// elements and keys in any order, whitespace, unknown fields, short string
// labels, escapes, field names in another case.
func TestDecodeCiliumStyle(t *testing.T) {
	const file = `
	[
	  {"labels": {"world": "reserved:world", "2001-db8--0/32": {"source": "cidr", "key": "2001-db8--0/32"}},
	   "extra": [1, {"a": null}, true, 2.5e3], "id": 16777300},
	  {"labels": {"remote-node": {"source":"reserved","key":"remote-node","value":""},
	              "192.168.1.10\/32": {"Source":"cidr","Key":"192.168.1.10\u002f32"}},
	   "ID": 33554433},
	  {"id": 16777217, "labels": {"10.0.0.0/8": "cidr:10.0.0.0/8", "world": {"key":"world","source":"reserved"}}}
	]
	`
	ids, invalid, err := Decode([]byte(file))
	if err != nil || len(invalid) != 0 {
		t.Fatal(err, invalid)
	}
	want := []identity.Identity{
		{ID: 16777300, Labels: labels.FromPrefix(mustPrefix("2001:db8::/32"), false)},
		{ID: 33554433, Labels: labels.MustNew(labels.Label{Source: "cidr", Key: "192.168.1.10/32"}, labels.LabelRemoteNode)},
		{ID: 16777217, Labels: labels.FromPrefix(mustPrefix("10.0.0.0/8"), false)},
	}
	if got, want := describe(ids), describe(want); got != want {
		t.Fatalf("got\n%swant\n%s", got, want)
	}
}

func TestRoundTrip(t *testing.T) {
	in := cidrIdentities(1000)
	in = append(in,
		&identity.Identity{ID: 0x02000001, Labels: labels.MustNew(labels.Label{Source: "cidr", Key: "10.9.9.9/32"}, labels.LabelRemoteNode)},
		&identity.Identity{ID: 0x01000F00, Labels: labels.MustNew(labels.Label{Source: "fqdn", Key: `name"with\quotes`, Value: "é€𝄞 = x"}, labels.LabelWorldIPv6)},
	)
	data := AppendJSON(nil, in)
	if !json.Valid(data) {
		t.Fatal("not valid JSON")
	}
	out, invalid, err := Decode(data)
	if err != nil || len(invalid) != 0 {
		t.Fatal(err, invalid)
	}
	want := values(in)
	slices.SortFunc(want, func(a, b identity.Identity) int { return int(a.ID) - int(b.ID) })
	if describe(out) != describe(want) {
		t.Fatal("round trip changed the identities")
	}
	if again := AppendJSON(nil, pointers(out)); !bytes.Equal(again, data) {
		t.Fatal("re-encoding differs")
	}
	// encoding/json reads the same thing.
	var generic []struct {
		ID     uint32                  `json:"id"`
		Labels map[string]labels.Label `json:"labels"`
	}
	if err := json.Unmarshal(data, &generic); err != nil || len(generic) != len(in) {
		t.Fatal(err, len(generic))
	}
}

func pointers(ids []identity.Identity) []*identity.Identity {
	out := make([]*identity.Identity, len(ids))
	for i := range ids {
		out[i] = &ids[i]
	}
	return out
}

func TestDecodeInvalidEntries(t *testing.T) {
	const valid = `{"id":16777217,"labels":{"10.0.0.0/8":"cidr:10.0.0.0/8","world":"reserved:world"}}`
	entries := []struct {
		json string
		want error
	}{
		{valid, nil},
		{`{"id":256,"labels":{"app":"k8s:app=web"}}`, ErrNotLocalScope},
		{`{"id":16777218,"labels":{"app":"k8s:app=web"}}`, ErrScopeMismatch},
		{`{"id":33554434,"labels":{"10.0.0.1/32":"cidr:10.0.0.1/32","world":"reserved:world"}}`, ErrScopeMismatch},
		{`{"id":16777219,"labels":{"world":"reserved:world"}}`, ErrReservedSet},
		{`{"id":"16777220","labels":{"world":"reserved:world"}}`, ErrBadID},
		{`{"id":-1,"labels":{}}`, ErrBadID},
		{`{"id":1.5,"labels":{}}`, ErrBadID},
		{`{"id":4294967296,"labels":{}}`, ErrBadID},
		{`{"labels":{"10.0.0.2/32":"cidr:10.0.0.2/32"}}`, ErrBadID},
		{`{"id":16777221}`, ErrBadLabels},
		{`{"id":16777222,"labels":[]}`, ErrBadLabels},
		{`{"id":16777223,"labels":{"a;b":"cidr:a;b"}}`, ErrBadLabels},
		{`{"id":16777224,"labels":{"x":{"key":"y","source":"cidr"}}}`, ErrBadLabels},
		{`{"id":16777229,"labels":{"hello":{"key":"hello","source":"cidr"},"world":"reserved:world"}}`, ErrBadLabels},
		{`{"id":16777230,"labels":{"10.0.0.0/33":"cidr:10.0.0.0/33","world":"reserved:world"}}`, ErrBadLabels},
		{`{"id":16777225,"labels":{"x":{"key":"x","source":5}}}`, ErrBadLabels},
		{`{"id":16777226,"labels":{}}`, ErrBadLabels},
		{`{"id":16777217,"labels":{"10.0.0.3/32":"cidr:10.0.0.3/32","world":"reserved:world"}}`, ErrDuplicateID},
		{`{"id":16777227,"labels":{"10.0.0.0/8":"cidr:10.0.0.0/8","world":"reserved:world"}}`, ErrDuplicateSet},
		{`{"id":0,"labels":{}}`, ErrNotLocalScope},
		{`{"id":16777216,"labels":{"10.0.0.4/32":"cidr:10.0.0.4/32"}}`, ErrNotLocalScope},
		{`42`, ErrNotObject},
		{`{"id":16777228,"labels":{"10.0.0.5/32":{"key":"10.0.0.5/32","source":"cidr"},"world":{"key":"world","source":"reserved"}}}`, nil},
	}
	var parts []string
	for _, e := range entries {
		parts = append(parts, e.json)
	}
	ids, invalid, err := Decode([]byte("[" + strings.Join(parts, ",") + "]"))
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) != 2 || ids[0].ID != 16777217 || ids[1].ID != 16777228 {
		t.Fatalf("valid identities %v", ids)
	}
	got := map[int]error{}
	for _, e := range invalid {
		got[e.Index] = e.Reason
	}
	for i, e := range entries {
		switch {
		case e.want == nil && got[i] != nil:
			t.Errorf("entry %d %s: unexpected %v", i, e.json, got[i])
		case e.want != nil && !errors.Is(got[i], e.want):
			t.Errorf("entry %d %s: got %v, want %v", i, e.json, got[i], e.want)
		}
	}
	if !slices.IsSortedFunc(invalid, func(a, b InvalidEntry) int { return a.Index - b.Index }) {
		t.Error("invalid entries not in index order")
	}
}

func TestDecodeCorrupt(t *testing.T) {
	full := []byte(formatsExample)
	inputs := map[string]string{
		"empty":         "",
		"whitespace":    "  \n",
		"object":        `{"id":1}`,
		"number":        `42`,
		"garbage":       "\x00\xff\xfe garbage",
		"trailing":      "[] []",
		"unterminated":  `[{"id":16777217,"labels":{"a":"b`,
		"bad escape":    `[{"id":16777217,"labels":{"a\q":"b"}}]`,
		"control char":  "[{\"id\":16777217,\"labels\":{\"a\n\":\"b\"}}]",
		"missing comma": `[{"id":1} {"id":2}]`,
		"deep":          "[" + strings.Repeat("[", 100000),
		"bad literal":   `[nul]`,
		"bad number":    `[{"id":01}]`,
	}
	for i := 1; i < len(full)-1; i += 7 {
		inputs["truncated-"+strconv.Itoa(i)] = string(full[:i])
	}
	for name, in := range inputs {
		ids, _, err := Decode([]byte(in))
		if !errors.Is(err, ErrCorrupt) || ids != nil {
			t.Errorf("%s: got %v, %v; want a corrupt error", name, ids, err)
		}
	}
}

func TestDecodeNull(t *testing.T) {
	ids, invalid, err := Decode([]byte("null\n"))
	if err != nil || len(ids) != 0 || invalid != nil {
		t.Fatal(ids, invalid, err)
	}
}

// TestLoad covers the loader's outcomes: missing, valid, partially invalid,
// corrupt, too large, unreadable.
func TestLoad(t *testing.T) {
	now := func() time.Time { return time.Unix(1700000000, 0) }
	newDir := func(t *testing.T, content string) (string, string) {
		dir := t.TempDir()
		path := filepath.Join(dir, FileName)
		if content != "" {
			if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		return dir, path
	}
	l := Loader{Now: now}

	t.Run("missing", func(t *testing.T) {
		_, path := newDir(t, "")
		res, err := l.Load(path)
		if err != nil || res.Report.Found || res.Report.Corrupt != nil || len(res.Identities) != 0 {
			t.Fatalf("%+v %v", res, err)
		}
	})
	t.Run("valid", func(t *testing.T) {
		_, path := newDir(t, formatsExample)
		res, err := l.Load(path)
		if err != nil || res.Report.Valid != 2 || res.Report.SetAside != "" {
			t.Fatalf("%+v %v", res.Report, err)
		}
	})
	t.Run("partial", func(t *testing.T) {
		content := `[{"id":256,"labels":{}},` + formatsExample[1:]
		dir, path := newDir(t, content)
		res, err := l.Load(path)
		if err != nil || res.Report.Valid != 2 || len(res.Report.Invalid) != 1 || res.Report.Invalid[0].Index != 0 {
			t.Fatalf("%+v %v", res.Report, err)
		}
		want := filepath.Join(dir, FileName+".invalid-1700000000")
		if res.Report.SetAside != want {
			t.Fatalf("kept as %q, want %q", res.Report.SetAside, want)
		}
		for _, p := range []string{path, want} {
			if data, _ := os.ReadFile(p); string(data) != content {
				t.Fatalf("%s: %q", p, data)
			}
		}
	})
	t.Run("corrupt", func(t *testing.T) {
		dir, path := newDir(t, "garbage")
		// Earlier corrupt files of the same second are not overwritten.
		taken := filepath.Join(dir, FileName+".corrupt-1700000000")
		os.WriteFile(taken, []byte("older"), 0o600)
		res, err := l.Load(path)
		if err != nil || !errors.Is(res.Report.Corrupt, ErrCorrupt) || len(res.Identities) != 0 {
			t.Fatalf("%+v %v", res.Report, err)
		}
		if res.Report.SetAside != taken+"-1" {
			t.Fatalf("kept as %q", res.Report.SetAside)
		}
		if data, _ := os.ReadFile(taken); string(data) != "older" {
			t.Fatal("older corrupt file overwritten")
		}
		if data, _ := os.ReadFile(res.Report.SetAside); string(data) != "garbage" {
			t.Fatal("corrupt file not kept")
		}
		if _, err := os.Stat(path); !os.IsNotExist(err) {
			t.Fatal("corrupt file still in place")
		}
	})
	t.Run("too large", func(t *testing.T) {
		_, path := newDir(t, formatsExample)
		res, err := Loader{Now: now, MaxSize: 10}.Load(path)
		if err != nil || !errors.Is(res.Report.Corrupt, ErrTooLarge) || res.Report.SetAside == "" {
			t.Fatalf("%+v %v", res.Report, err)
		}
	})
	t.Run("huge sparse", func(t *testing.T) {
		_, path := newDir(t, formatsExample)
		if err := os.Truncate(path, MaxFileSize+1); err != nil {
			t.Fatal(err)
		}
		res, err := l.Load(path)
		if err != nil || !errors.Is(res.Report.Corrupt, ErrTooLarge) || res.Report.SetAside == "" {
			t.Fatalf("%+v %v", res.Report, err)
		}
	})
	t.Run("unreadable", func(t *testing.T) {
		_, path := newDir(t, "")
		if err := os.Mkdir(path, 0o700); err != nil {
			t.Fatal(err)
		}
		res, err := l.Load(path)
		if err != nil || res.Report.Corrupt == nil || res.Report.SetAside == "" {
			t.Fatalf("%+v %v", res.Report, err)
		}
	})
	t.Run("fifo", func(t *testing.T) {
		// A FIFO would block an ordinary open until a writer came, and
		// with it the agent's start.
		_, path := newDir(t, "")
		if err := syscall.Mkfifo(path, 0o600); err != nil {
			t.Fatal(err)
		}
		type loaded struct {
			res LoadResult
			err error
		}
		done := make(chan loaded, 1)
		go func() {
			res, err := l.Load(path)
			done <- loaded{res, err}
		}()
		select {
		case got := <-done:
			if got.err != nil || !errors.Is(got.res.Report.Corrupt, ErrCorrupt) || got.res.Report.SetAside == "" {
				t.Fatalf("%+v %v", got.res.Report, got.err)
			}
			if _, err := os.Lstat(path); !os.IsNotExist(err) {
				t.Fatal("the FIFO is still in place")
			}
		case <-time.After(10 * time.Second):
			// Unblock the open so that the goroutine ends.
			if f, err := os.OpenFile(path, os.O_WRONLY, 0); err == nil {
				f.Close()
			}
			t.Fatal("loading a FIFO as the checkpoint blocked")
		}
	})
}

func TestWriteFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, FileName)
	if err := WriteFile(path, []byte("[]\n")); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("%v %v", fi.Mode(), err)
	}
	// A stale temporary file of a crashed write, with a wrong mode, is
	// replaced.
	os.WriteFile(path+tempSuffix, []byte("stale"), 0o644)
	if err := WriteFile(path, []byte(formatsExample)); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path + tempSuffix); !os.IsNotExist(err) {
		t.Fatal("temporary file left")
	}
	for _, step := range []string{"write", "fsync", "close", "rename"} {
		err := writeFile(path, []byte("new content"), func(s string) error {
			if s == step {
				return errors.New("injected")
			}
			return nil
		})
		if err == nil || !strings.Contains(err.Error(), step) {
			t.Fatalf("%s: %v", step, err)
		}
		if data, _ := os.ReadFile(path); string(data) != formatsExample {
			t.Fatalf("failed %s changed the file: %q", step, data)
		}
		if _, err := os.Stat(path + tempSuffix); !os.IsNotExist(err) {
			t.Fatalf("failed %s left the temporary file", step)
		}
	}
}
