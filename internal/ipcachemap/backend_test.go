package ipcachemap

import (
	"errors"
	"net/netip"
	"testing"

	"github.com/identityd/identityd/identity"
)

type identityNum = identity.NumericIdentity

// backends opens each backend in a fresh place; bpf is skipped where the
// kernel or privileges do not allow it.
func backends(t *testing.T, maxEntries uint32) map[string]func(t *testing.T) Map {
	return map[string]func(t *testing.T) Map{
		"file": func(t *testing.T) Map {
			m, _, err := Open(Config{Kind: KindFile, FilePath: tempFilePath(t), MaxEntries: maxEntries})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { m.Close() })
			return m
		},
		"bpf": func(t *testing.T) Map {
			m, _ := openTestBPF(t, Config{MaxEntries: maxEntries})
			return m
		},
		// The fallback for kernels without batch syscalls on LPM tries.
		"bpf-no-batch": func(t *testing.T) Map {
			m, _ := openTestBPF(t, Config{MaxEntries: maxEntries})
			disableBatch(m)
			return m
		},
	}
}

func pfx(s string) netip.Prefix { return netip.MustParsePrefix(s) }

func TestBackendLPM(t *testing.T) {
	for name, open := range backends(t, 1000) {
		t.Run(name, func(t *testing.T) {
			m := open(t)
			for _, e := range []Entry{
				{Key{Prefix: pfx("10.0.0.0/8")}, Value{Identity: 100}},
				{Key{Prefix: pfx("10.1.0.0/16")}, Value{Identity: 200}},
				{Key{Prefix: pfx("10.1.2.3/32")}, Value{Identity: 300, TunnelEndpoint: netip.MustParseAddr("192.168.0.7"), Flags: FlagSkipTunnel}},
				{Key{Prefix: pfx("10.0.0.0/8"), ClusterID: 3}, Value{Identity: 400}},
				{Key{Prefix: pfx("0.0.0.0/0")}, Value{Identity: 2}},
				{Key{Prefix: pfx("2001:db8::/32")}, Value{Identity: 500}},
				{Key{Prefix: pfx("2001:db8:1::/48")}, Value{Identity: 600}},
			} {
				if err := m.Update(e.Key, e.Value); err != nil {
					t.Fatal(err)
				}
			}
			for _, tc := range []struct {
				key  Key
				want identity.NumericIdentity // 0: not found
			}{
				{Key{Prefix: pfx("10.1.2.3/32")}, 300},
				{Key{Prefix: pfx("10.1.2.4/32")}, 200},
				{Key{Prefix: pfx("10.2.0.1/32")}, 100},
				{Key{Prefix: pfx("10.1.0.0/16")}, 200},
				{Key{Prefix: pfx("10.1.0.0/12")}, 100}, // shorter than the /16
				{Key{Prefix: pfx("11.0.0.1/32")}, 2},
				{Key{Prefix: pfx("10.9.9.9/32"), ClusterID: 3}, 400},
				{Key{Prefix: pfx("11.0.0.1/32"), ClusterID: 3}, 0}, // /0 is cluster 0's
				{Key{Prefix: pfx("10.1.2.3/32"), ClusterID: 4}, 0},
				{Key{Prefix: pfx("2001:db8:1::5/128")}, 600},
				{Key{Prefix: pfx("2001:db8:2::5/128")}, 500},
				{Key{Prefix: pfx("2001:db9::1/128")}, 0}, // /0 is IPv4's
			} {
				v, ok, err := m.Lookup(tc.key)
				if err != nil {
					t.Fatal(err)
				}
				if got := map[bool]identity.NumericIdentity{true: v.Identity}[ok]; got != tc.want {
					t.Errorf("Lookup(%v) = %d (found %v), want %d", tc.key, v.Identity, ok, tc.want)
				}
			}
			v, _, _ := m.Lookup(Key{Prefix: pfx("10.1.2.3/32")})
			if v.TunnelEndpoint != netip.MustParseAddr("192.168.0.7") || v.Flags != FlagSkipTunnel {
				t.Errorf("value fields lost: %+v", v)
			}

			// Delete is exact and idempotent.
			if err := m.Delete(Key{Prefix: pfx("10.1.0.0/16")}); err != nil {
				t.Fatal(err)
			}
			if err := m.Delete(Key{Prefix: pfx("10.1.0.0/16")}); err != nil {
				t.Fatalf("second delete: %v", err)
			}
			if v, _, _ := m.Lookup(Key{Prefix: pfx("10.1.2.4/32")}); v.Identity != 100 {
				t.Errorf("after delete of /16: identity %d, want 100", v.Identity)
			}
			if n, err := m.Len(); err != nil || n != 6 {
				t.Errorf("Len = %d, %v; want 6", n, err)
			}
		})
	}
}

func TestBackendBatch(t *testing.T) {
	for name, open := range backends(t, 20000) {
		t.Run(name, func(t *testing.T) {
			m := open(t)
			// More than one batch chunk.
			entries := testEntries(2*batchSize + 17)
			if err := m.UpdateBatch(entries); err != nil {
				t.Fatal(err)
			}
			got, err := Snapshot(m)
			if err != nil {
				t.Fatal(err)
			}
			equalEntries(t, got, entries)

			// Delete every other entry, plus keys that were never there.
			var del []Key
			var keep []Entry
			for i, e := range entries {
				if i%2 == 0 {
					del = append(del, e.Key)
				} else {
					keep = append(keep, e)
				}
			}
			del = append(del, Key{Prefix: pfx("203.0.113.0/24")}, del[0])
			if err := m.DeleteBatch(del); err != nil {
				t.Fatal(err)
			}
			var dumped []Entry
			if err := m.Dump(func(k Key, v Value) bool {
				dumped = append(dumped, Entry{k, v})
				return true
			}); err != nil {
				t.Fatal(err)
			}
			equalEntries(t, dumped, keep)

			// Dump stops when told.
			n := 0
			m.Dump(func(Key, Value) bool { n++; return n < 3 })
			if n != 3 {
				t.Errorf("Dump went on after yield returned false: %d calls", n)
			}
		})
	}
}

func TestBackendFull(t *testing.T) {
	for name, open := range backends(t, 10) {
		t.Run(name, func(t *testing.T) {
			m := open(t)
			entries := testEntries(11)
			if err := m.UpdateBatch(entries[:10]); err != nil {
				t.Fatal(err)
			}
			// Replacing an existing key works when full.
			if err := m.Update(entries[0].Key, Value{Identity: 9}); err != nil {
				t.Fatalf("update of existing key in full map: %v", err)
			}
			if err := m.Update(entries[10].Key, entries[10].Value); !errors.Is(err, ErrFull) {
				t.Fatalf("update beyond max entries: err = %v, want ErrFull", err)
			}
		})
	}
}

func TestBackendInvalid(t *testing.T) {
	for name, open := range backends(t, 10) {
		t.Run(name, func(t *testing.T) {
			m := open(t)
			if err := m.Update(Key{}, Value{}); !errors.Is(err, ErrInvalidKey) {
				t.Errorf("Update(zero key) = %v", err)
			}
			if err := m.Update(Key{Prefix: pfx("10.0.0.0/8")}, Value{TunnelEndpoint: netip.MustParseAddr("::1")}); !errors.Is(err, ErrInvalidValue) {
				t.Errorf("Update(ipv6 tunnel) = %v", err)
			}
			if _, _, err := m.Lookup(Key{}); !errors.Is(err, ErrInvalidKey) {
				t.Errorf("Lookup(zero key) = %v", err)
			}
			m.Close()
			if err := m.Update(Key{Prefix: pfx("10.0.0.0/8")}, Value{}); !errors.Is(err, ErrClosed) {
				t.Errorf("Update after Close = %v, want ErrClosed", err)
			}
			if err := m.Close(); err != nil {
				t.Errorf("second Close = %v", err)
			}
		})
	}
}

func TestOpenUnknownKind(t *testing.T) {
	if _, _, err := Open(Config{Kind: "tmpfs"}); err == nil {
		t.Fatal("unknown kind accepted")
	}
	if _, _, err := Open(Config{Kind: KindFile}); err == nil {
		t.Fatal("file kind without a path accepted")
	}
}
