package labels

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"strings"
	"testing"
	"testing/quick"
)

func TestParseLabel(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Label
	}{
		{"k8s:app=web", Label{Source: "k8s", Key: "app", Value: "web"}},
		{"app=web", Label{Source: SourceUnspec, Key: "app", Value: "web"}},
		{"$host", Label{Source: SourceReserved, Key: "host"}},
		{"reserved:world", Label{Source: SourceReserved, Key: "world"}},
		{"cidr:10.0.0.0/8", Label{Source: SourceCIDR, Key: "10.0.0.0/8"}},
		// Later ':' belong to the key; a value may contain '='.
		{"k8s:io.kubernetes:pod=a=b", Label{Source: "k8s", Key: "io.kubernetes:pod", Value: "a=b"}},
		{"k8s:a=b:c", Label{Source: "k8s", Key: "a", Value: "b:c"}},
		{":key", Label{Source: SourceUnspec, Key: "key"}},
		{"cidr:2001-db8--0/32", Label{Source: SourceCIDR, Key: "2001-db8--0/32"}},
		// Every key CIDRKey writes, as Cilium writes them.
		{"cidr:0--1/128", Label{Source: SourceCIDR, Key: "0--1/128"}},
		{"cidr:0--0/0", Label{Source: SourceCIDR, Key: "0--0/0"}},
		{"cidr:0.0.0.0/0", Label{Source: SourceCIDR, Key: "0.0.0.0/0"}},
		{"cidr:fe80--0/10", Label{Source: SourceCIDR, Key: "fe80--0/10"}},
		{"cidr:2001-db8--1-0/128", Label{Source: SourceCIDR, Key: "2001-db8--1-0/128"}},
		{"cidr:0--ffff-10.0.0.0/104", Label{Source: SourceCIDR, Key: "0--ffff-10.0.0.0/104"}},
		{"cidr:192.168.1.10/32", Label{Source: SourceCIDR, Key: "192.168.1.10/32"}},
	} {
		got, err := ParseLabel(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("ParseLabel(%q) = %+v, %v; want %+v", tc.in, got, err, tc.want)
		}
	}
}

func TestParseLabelErrors(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want error
	}{
		{"k8s:", ErrEmptyKey},
		{"k8s:=v", ErrEmptyKey},
		{"", ErrEmptyKey},
		{"k8s:a;b", ErrSemicolon},
		{"k8s:a=b;c", ErrSemicolon},
		{"k8s:a\x00b", ErrControlChar},
		{"k8s:a=b\nc", ErrControlChar},
		{"k8s:a=\x7f", ErrControlChar},
		{"k8s:a=\xff", ErrInvalidUTF8},
		{"k/s:a", ErrBadSource},
		// A cidr label is a masked prefix as CIDRKey writes it, without
		// a value.
		{"cidr:hello", ErrBadCIDR},
		{"cidr:10.0.0.0/33", ErrBadCIDR},
		{"cidr:10.0.0.0", ErrBadCIDR},
		{"cidr:10.0.0.1/8", ErrBadCIDR},
		{"cidr:010.0.0.0/8", ErrBadCIDR},
		{"cidr:10.0.0.0/08", ErrBadCIDR},
		{"cidr:10.0.0.0/8=x", ErrBadCIDR},
		{"cidr:2001:db8::/32", ErrBadCIDR},
		{"cidr:2001-0db8--0/32", ErrBadCIDR},
		{"cidr:2001-DB8--0/32", ErrBadCIDR},
		{"cidr:--1/128", ErrBadCIDR},
		{"cidr:fe80--1%eth0/128", ErrBadCIDR},
		{"cidr:2001-db8--0/129", ErrBadCIDR},
		{"cidr:", ErrEmptyKey},
	} {
		_, err := ParseLabel(tc.in)
		if !errors.Is(err, tc.want) {
			t.Errorf("ParseLabel(%q) error %v, want %v", tc.in, err, tc.want)
			continue
		}
		var ile *InvalidLabelError
		if !errors.As(err, &ile) || ile.Label != tc.in {
			t.Errorf("ParseLabel(%q) error %v does not name the label", tc.in, err)
		}
	}
	// Labels built in code are checked too: '=' in a key and ':' in a
	// source cannot come from the text form.
	for _, tc := range []struct {
		l    Label
		want error
	}{
		{Label{Source: "k8s", Key: "a=b"}, ErrEqualsInKey},
		{Label{Source: "a:b", Key: "k"}, ErrBadSource},
		{Label{Source: "$x", Key: "k"}, ErrBadSource},
		{Label{Key: "k"}, ErrEmptySource},
	} {
		if err := tc.l.Validate(); !errors.Is(err, tc.want) {
			t.Errorf("%+v.Validate() = %v, want %v", tc.l, err, tc.want)
		}
	}
}

func TestSetsAndCanonical(t *testing.T) {
	ls := MustParse("k8s:io.kubernetes.pod.namespace=default", "k8s:app=nginx")
	if got, want := ls.Canonical(), "k8s:app=nginx;k8s:io.kubernetes.pod.namespace=default;"; got != want {
		t.Fatalf("Canonical = %q, want %q", got, want)
	}
	if got := ls.String(); got != "k8s:app=nginx,k8s:io.kubernetes.pod.namespace=default" {
		t.Fatalf("String = %q", got)
	}
	back, err := ParseCanonical(ls.Canonical())
	if err != nil || !back.Equal(ls) {
		t.Fatalf("ParseCanonical = %v, %v", back, err)
	}
	// Empty values keep '=' in the canonical form.
	if got := MustParse("reserved:world", "cidr:10.0.0.0/8").Canonical(); got != "cidr:10.0.0.0/8=;reserved:world=;" {
		t.Fatalf("Canonical = %q", got)
	}
	// Keyed by key only.
	if _, err := Parse("k8s:app=a", "container:app=b"); !errors.Is(err, ErrDuplicateKey) {
		t.Fatalf("duplicate key: %v", err)
	}
	if l, ok := ls.Get("app"); !ok || l.Value != "nginx" {
		t.Fatal("Get")
	}
	if !ls.Has(Label{Source: "k8s", Key: "app", Value: "nginx"}) || ls.Has(Label{Source: "container", Key: "app", Value: "nginx"}) {
		t.Fatal("Has compares source and value too")
	}
	m := Merge(MustParse("k8s:a=1", "k8s:b=2"), MustParse("k8s:b=3", "k8s:c=4"))
	if m.String() != "k8s:a=1,k8s:b=3,k8s:c=4" {
		t.Fatalf("Merge = %s", m)
	}
	if ParseListMust(t, m.String()).Compare(m) != 0 {
		t.Fatal("ParseList(String()) differs")
	}
}

func ParseListMust(t *testing.T, s string) Labels {
	ls, err := ParseList(s)
	if err != nil {
		t.Fatal(err)
	}
	return ls
}

func TestParseCanonicalErrors(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want error
	}{
		{"k8s:a=b", ErrMissingTerminal},
		{"k8s:a;", ErrMissingEquals},
		{"a=b;", ErrMissingColon},
		{"k8s:b=1;k8s:a=2;", ErrUnsorted},
		{"k8s:a=1;k8s:a=2;", ErrDuplicateKey},
		{":a=1;", ErrEmptySource},
		{"k8s:=1;", ErrEmptyKey},
		{"k8s:a=1;;", ErrMissingColon},
		{strings.Repeat("k8s:a=1;", MaxLabels+1), ErrLimit},
	} {
		if _, err := ParseCanonical(tc.in); !errors.Is(err, tc.want) {
			t.Errorf("ParseCanonical(%.40q) = %v, want %v", tc.in, err, tc.want)
		}
	}
}

func TestLimits(t *testing.T) {
	many := make([]Label, MaxLabels+1)
	for i := range many {
		many[i] = Label{Source: "k8s", Key: fmt.Sprintf("k%03d", i)}
	}
	if _, err := New(many...); !errors.Is(err, ErrLimit) {
		t.Fatalf("too many labels: %v", err)
	}
	if _, err := New(many[:MaxLabels]...); err != nil {
		t.Fatalf("MaxLabels labels refused: %v", err)
	}
	big := Label{Source: "k8s", Key: "big", Value: strings.Repeat("v", MaxCanonicalBytes)}
	var le *LimitError
	if _, err := New(big); !errors.As(err, &le) || le.Limit != MaxCanonicalBytes {
		t.Fatalf("oversized set: %v", err)
	}
}

func TestCIDRLabels(t *testing.T) {
	for _, tc := range []struct {
		prefix    string
		dualStack bool
		want      string
	}{
		{"10.0.0.0/8", false, "cidr:10.0.0.0/8=;reserved:world=;"},
		{"10.1.2.3/8", false, "cidr:10.0.0.0/8=;reserved:world=;"},
		{"192.168.1.10/32", true, "cidr:192.168.1.10/32=;reserved:world-ipv4=;"},
		{"2001:db8::/32", false, "cidr:2001-db8--0/32=;reserved:world=;"},
		{"::1/128", false, "cidr:0--1/128=;reserved:world=;"},
		{"2001:db8::1/128", true, "cidr:2001-db8--1/128=;reserved:world-ipv6=;"},
		{"fe80::/10", false, "cidr:fe80--0/10=;reserved:world=;"},
		{"::/1", false, "cidr:0--0/1=;reserved:world=;"},
		{"0.0.0.0/0", false, "reserved:world=;"},
		{"::/0", true, "reserved:world-ipv6=;"},
		{"0.0.0.0/0", true, "reserved:world-ipv4=;"},
	} {
		ls := FromPrefix(netip.MustParsePrefix(tc.prefix), tc.dualStack)
		if got := ls.Canonical(); got != tc.want {
			t.Errorf("FromPrefix(%s, %v) = %q, want %q", tc.prefix, tc.dualStack, got, tc.want)
		}
		if err := ls.Validate(); err != nil {
			t.Errorf("FromPrefix(%s) invalid: %v", tc.prefix, err)
		}
	}
}

// randomLabels builds a valid label set from a seed; the values use the
// characters that the formats treat specially where they are allowed.
func randomLabels(r *rand.Rand) Labels {
	const keyChars = "abcxyz.-_/:0123456789é"
	const valChars = "abc=:/-_ 09é"
	pick := func(chars string, n int) string {
		rs := []rune(chars)
		var b strings.Builder
		for range n {
			b.WriteRune(rs[r.IntN(len(rs))])
		}
		return b.String()
	}
	sources := []string{"k8s", "cidr", "reserved", "fqdn", "container", "unspec", "any", "x.y"}
	n := r.IntN(6)
	seen := map[string]bool{}
	var ls []Label
	for range n {
		l := Label{Source: sources[r.IntN(len(sources))], Key: pick(keyChars, 1+r.IntN(10)), Value: pick(valChars, r.IntN(8))}
		if l.Source == SourceCIDR {
			// A cidr label is a prefix's key without a value.
			var a [16]byte
			for i := range a {
				a[i] = byte(r.Uint32())
			}
			addr := netip.AddrFrom16(a)
			if r.IntN(2) == 0 {
				addr = netip.AddrFrom4([4]byte(a[:4]))
			}
			l.Key, l.Value = CIDRKey(netip.PrefixFrom(addr, r.IntN(addr.BitLen()+1))), ""
		}
		if seen[l.Key] {
			continue
		}
		seen[l.Key] = true
		ls = append(ls, l)
	}
	out, err := New(ls...)
	if err != nil {
		panic(err)
	}
	return out
}

// TestRoundTripProperty: parse(format(x)) == x for valid label sets, in
// the canonical, text and printable forms.
func TestRoundTripProperty(t *testing.T) {
	f := func(seed uint64) bool {
		ls := randomLabels(rand.New(rand.NewPCG(seed, seed>>7)))
		c, err := ParseCanonical(ls.Canonical())
		if err != nil || !c.Equal(ls) {
			t.Logf("canonical %q: %v %v", ls.Canonical(), c, err)
			return false
		}
		p, err := Parse(ls.Strings()...)
		if err != nil || !p.Equal(ls) {
			t.Logf("text %q: %v %v", ls.Strings(), p, err)
			return false
		}
		return true
	}
	if err := quick.Check(f, &quick.Config{MaxCount: 5000}); err != nil {
		t.Fatal(err)
	}
}

func FuzzParseLabel(f *testing.F) {
	for _, s := range []string{"k8s:app=web", "$host", "app", "a:b:c=d=e", "cidr:0--1/128", "cidr:hello", "cidr:10.0.0.0/33", "cidr:2001:db8::/32", "k8s:a;b", "", ":", "=", "x\x00y", "\xff"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		l, err := ParseLabel(s)
		if err != nil {
			var ile *InvalidLabelError
			if !errors.As(err, &ile) {
				t.Fatalf("untyped error %v", err)
			}
			return
		}
		// A parsed label round-trips through the text form.
		back, err := ParseLabel(l.String())
		if err != nil || back != l {
			t.Fatalf("%q -> %+v -> %q -> %+v, %v", s, l, l.String(), back, err)
		}
		ls, err := New(l)
		if err != nil {
			t.Fatalf("valid label refused as a set: %v", err)
		}
		c, err := ParseCanonical(ls.Canonical())
		if err != nil || !c.Equal(ls) {
			t.Fatalf("canonical round trip of %+v: %v %v", l, c, err)
		}
	})
}

func FuzzParseCanonical(f *testing.F) {
	for _, s := range []string{"k8s:app=nginx;k8s:io.kubernetes.pod.namespace=default;", "cidr:10.0.0.0/8=;reserved:world=;", "", ";", "a:b", "k8s:b=1;k8s:a=2;", "x:=;"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		ls, err := ParseCanonical(s)
		if err != nil {
			var ile *InvalidLabelError
			var le *LimitError
			if !errors.As(err, &ile) && !errors.As(err, &le) {
				t.Fatalf("untyped error %v", err)
			}
			return
		}
		// One set, one string.
		if got := ls.Canonical(); got != s {
			t.Fatalf("ParseCanonical(%q).Canonical() = %q", s, got)
		}
	})
}

// TestParseIPv4PrefixAgreesWithNetip checks the fast path of cidr label
// keys against netip on every shape of IPv4 prefix text it may meet.
func TestParseIPv4PrefixAgreesWithNetip(t *testing.T) {
	cases := []string{
		"10.0.0.0/8", "10.0.0.1/8", "0.0.0.0/0", "1.2.3.4/0", "255.255.255.255/32", "192.168.1.10/32",
		"10.0.0.0/33", "10.0.0.0/08", "010.0.0.0/8", "10.0.0/8", "10.0.0.0.0/8", "256.0.0.0/8",
		"10.0.0.0", "10.0.0.0/", "/8", "10.0.0.0/8x", "10..0.0/8", "1.2.3.4/-1", "1.2.3.4/+1",
		"1000.0.0.0/8", "10.0.0.0/100", "10.0.0.128/25", "10.0.0.64/25", "2001:db8::/32",
	}
	for a := range 256 {
		for _, bits := range []int{0, 1, 7, 8, 9, 16, 24, 31, 32} {
			cases = append(cases, fmt.Sprintf("%d.%d.%d.%d/%d", a, 255-a, a/2, a%7, bits))
		}
	}
	for _, s := range cases {
		masked, ok := parseIPv4Prefix(s)
		p, err := netip.ParsePrefix(s)
		wantOK := err == nil && p.Addr().Is4()
		if ok != wantOK {
			t.Errorf("%q: fast path ok=%v, netip %v %v", s, ok, p, err)
			continue
		}
		if ok && masked != (p.Masked() == p) {
			t.Errorf("%q: fast path masked=%v, netip masked %v", s, masked, p.Masked())
		}
	}
}
