package ipcache

import (
	"net/netip"
	"testing"
)

// FuzzParsePrefixes feeds arbitrary arguments to the prefix parsing of the
// ipcache/* shell commands: no input may panic, and an accepted prefix
// must be valid and parse back to itself from its text form.
func FuzzParsePrefixes(f *testing.F) {
	for _, s := range []string{"10.0.0.0/8", "192.168.1.1", "2001:db8::/32", "::1", "10.0.0.0/33",
		"fe80::1%eth0", "1.2.3.4/-1", "", "/", "::ffff:10.0.0.1/128", "010.0.0.1"} {
		f.Add(s, "10.1.0.0/16")
	}
	f.Fuzz(func(t *testing.T, a, b string) {
		ps, err := parsePrefixes([]string{a, b})
		if err != nil {
			if ps != nil {
				t.Fatalf("%q %q: prefixes %v beside error %v", a, b, ps, err)
			}
			return
		}
		if len(ps) != 2 {
			t.Fatalf("%q %q: %d prefixes", a, b, len(ps))
		}
		for _, p := range ps {
			if !p.IsValid() {
				t.Fatalf("%q %q: invalid prefix %v accepted", a, b, p)
			}
			q, err := parsePrefix(p.String())
			if err != nil || q != p {
				t.Fatalf("%v does not round-trip: %v, %v", p, q, err)
			}
			if _, err := netip.ParsePrefix(p.String()); err != nil {
				t.Fatalf("%v prints as a prefix netip refuses: %v", p, err)
			}
		}
	})
}
