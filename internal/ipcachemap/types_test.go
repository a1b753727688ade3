package ipcachemap

import (
	"bytes"
	"encoding/hex"
	"errors"
	"net/netip"
	"strings"
	"testing"

	"github.com/identityd/identityd/identity"
)

// unhex reads hex with spaces and | separators, for readable layouts.
func unhex(t testing.TB, s string) []byte {
	t.Helper()
	s = strings.NewReplacer(" ", "", "|", "", "\n", "", "\t", "").Replace(s)
	b, err := hex.DecodeString(s)
	if err != nil {
		t.Fatalf("bad hex %q: %v", s, err)
	}
	return b
}

func requireLittleEndian(t *testing.T) {
	t.Helper()
	if nativeOrder() != orderLittle {
		t.Skip("expected layouts are written for little-endian hosts; TestNativeOrder covers big endian")
	}
}

func TestKeyLayout(t *testing.T) {
	requireLittleEndian(t)
	for _, tc := range []struct {
		name string
		key  Key
		want string // prefixlen | cluster | pad | family | address
	}{
		{"ipv4 /8", Key{Prefix: netip.MustParsePrefix("10.0.0.0/8")},
			"28000000 | 0000 | 00 | 01 | 0a000000 000000000000000000000000"},
		{"ipv4 host bits are masked", Key{Prefix: netip.MustParsePrefix("10.1.2.3/8")},
			"28000000 | 0000 | 00 | 01 | 0a000000 000000000000000000000000"},
		{"ipv4 /32 cluster 5", Key{Prefix: netip.MustParsePrefix("192.168.1.10/32"), ClusterID: 5},
			"40000000 | 0500 | 00 | 01 | c0a8010a 000000000000000000000000"},
		{"ipv4 /0", Key{Prefix: netip.MustParsePrefix("0.0.0.0/0")},
			"20000000 | 0000 | 00 | 01 | 00000000 000000000000000000000000"},
		{"ipv6 /32 cluster 511", Key{Prefix: netip.MustParsePrefix("2001:db8::/32"), ClusterID: 511},
			"40000000 | ff01 | 00 | 02 | 20010db8 000000000000000000000000"},
		{"ipv6 /128", Key{Prefix: netip.MustParsePrefix("::1/128")},
			"a0000000 | 0000 | 00 | 02 | 00000000 000000000000000000000001"},
		{"ipv6 /64", Key{Prefix: netip.MustParsePrefix("fd00:1:2:3:4:5:6:7/64"), ClusterID: 0x0102},
			"60000000 | 0201 | 00 | 02 | fd000001 000200030000000000000000"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want := unhex(t, tc.want)
			got, err := tc.key.MarshalBinary()
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("MarshalBinary\n got %x\nwant %x", got, want)
			}
			var back Key
			if err := back.UnmarshalBinary(want); err != nil {
				t.Fatal(err)
			}
			wantKey := Key{Prefix: tc.key.Prefix.Masked(), ClusterID: tc.key.ClusterID}
			if back != wantKey {
				t.Fatalf("UnmarshalBinary = %v, want %v", back, wantKey)
			}
		})
	}
}

func TestValueLayout(t *testing.T) {
	requireLittleEndian(t)
	for _, tc := range []struct {
		name  string
		value Value
		want  string // identity | tunnel | pad | key | flags
	}{
		{"zero", Value{}, "00000000 | 00000000 | 0000 | 00 | 00"},
		{"local identity", Value{Identity: 16777217}, "01000001 | 00000000 | 0000 | 00 | 00"},
		{"all fields", Value{
			Identity:       identity.NumericIdentity(0x00123456),
			TunnelEndpoint: netip.MustParseAddr("192.168.0.1"),
			EncryptKey:     3,
			Flags:          FlagSkipTunnel,
		}, "56341200 | c0a80001 | 0000 | 03 | 01"},
		{"world", Value{Identity: 2, TunnelEndpoint: netip.MustParseAddr("10.0.0.254")},
			"02000000 | 0a0000fe | 0000 | 00 | 00"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want := unhex(t, tc.want)
			got, err := tc.value.MarshalBinary()
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("MarshalBinary\n got %x\nwant %x", got, want)
			}
			var back Value
			if err := back.UnmarshalBinary(want); err != nil {
				t.Fatal(err)
			}
			if back != tc.value {
				t.Fatalf("UnmarshalBinary = %+v, want %+v", back, tc.value)
			}
		})
	}
}

// TestNativeOrder checks the integer fields follow the host's order on any
// host, which the little-endian literals above cannot.
func TestNativeOrder(t *testing.T) {
	k, _ := Key{Prefix: netip.MustParsePrefix("10.0.0.0/8"), ClusterID: 0x0102}.MarshalBinary()
	v, _ := Value{Identity: 0x01020304}.MarshalBinary()
	var pl, cid, id [4]byte
	if nativeOrder() == orderLittle {
		pl, cid, id = [4]byte{40, 0, 0, 0}, [4]byte{2, 1}, [4]byte{4, 3, 2, 1}
	} else {
		pl, cid, id = [4]byte{0, 0, 0, 40}, [4]byte{1, 2}, [4]byte{1, 2, 3, 4}
	}
	if [4]byte(k[0:4]) != pl || [2]byte(k[4:6]) != [2]byte(cid[:2]) || [4]byte(v[0:4]) != id {
		t.Fatalf("key %x value %x not in host byte order", k, v)
	}
	if !bytes.Equal(k[8:12], []byte{10, 0, 0, 0}) {
		t.Fatalf("address %x not in network order", k[8:12])
	}
}

func TestKeyErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		key  Key
	}{
		{"zero prefix", Key{}},
		{"ipv4-mapped", Key{Prefix: netip.MustParsePrefix("::ffff:10.0.0.0/104")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := tc.key.MarshalBinary(); !errors.Is(err, ErrInvalidKey) {
				t.Fatalf("err = %v, want ErrInvalidKey", err)
			}
		})
	}
	if _, err := (Value{TunnelEndpoint: netip.MustParseAddr("fd00::1")}).MarshalBinary(); !errors.Is(err, ErrInvalidValue) {
		t.Fatalf("ipv6 tunnel endpoint: err = %v, want ErrInvalidValue", err)
	}
}

func TestUnmarshalErrors(t *testing.T) {
	requireLittleEndian(t)
	for _, tc := range []struct {
		name, data, want string
	}{
		{"short", "28000000 0000 00 01", "bytes, want 24"},
		{"family 0", "28000000 | 0000 | 00 | 00 | 0a000000 000000000000000000000000", "unknown address family 0"},
		{"family 3", "28000000 | 0000 | 00 | 03 | 0a000000 000000000000000000000000", "unknown address family 3"},
		{"prefixlen below 32", "1f000000 | 0000 | 00 | 01 | 0a000000 000000000000000000000000", "out of range 32..64"},
		{"ipv4 prefixlen above 64", "41000000 | 0000 | 00 | 01 | 0a000000 000000000000000000000000", "out of range 32..64"},
		{"ipv6 prefixlen above 160", "a1000000 | 0000 | 00 | 02 | 0a000000 000000000000000000000000", "out of range 32..160"},
		{"padding", "28000000 | 0000 | 01 | 01 | 0a000000 000000000000000000000000", "non-zero padding"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var k Key
			err := k.UnmarshalBinary(unhex(t, tc.data))
			if !errors.Is(err, ErrInvalidKey) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want ErrInvalidKey containing %q", err, tc.want)
			}
		})
	}
	var v Value
	if err := v.UnmarshalBinary(make([]byte, 11)); !errors.Is(err, ErrInvalidValue) {
		t.Fatalf("short value: err = %v", err)
	}
}

func FuzzKeyUnmarshal(f *testing.F) {
	for _, p := range []string{"10.0.0.0/8", "2001:db8::/32", "0.0.0.0/0", "::/0", "1.2.3.4/32"} {
		b, _ := Key{Prefix: netip.MustParsePrefix(p), ClusterID: 7}.MarshalBinary()
		f.Add(b)
	}
	f.Add(make([]byte, KeySize))
	f.Fuzz(func(t *testing.T, data []byte) {
		var k Key
		if err := k.UnmarshalBinary(data); err != nil {
			return
		}
		b, err := k.MarshalBinary()
		if err != nil {
			t.Fatalf("decoded key %v does not marshal: %v", k, err)
		}
		var k2 Key
		if err := k2.UnmarshalBinary(b); err != nil || k2 != k {
			t.Fatalf("round trip %v -> %x -> %v, %v", k, b, k2, err)
		}
		// Prefix length, cluster ID, pad and family survive unchanged.
		if !bytes.Equal(b[:8], data[:8]) {
			t.Fatalf("header bytes changed: %x -> %x", data[:8], b[:8])
		}
	})
}

func FuzzValueUnmarshal(f *testing.F) {
	b, _ := Value{Identity: 16777217, TunnelEndpoint: netip.MustParseAddr("10.0.0.1"), EncryptKey: 2, Flags: 1}.MarshalBinary()
	f.Add(b)
	f.Add(make([]byte, ValueSize))
	f.Fuzz(func(t *testing.T, data []byte) {
		var v Value
		if err := v.UnmarshalBinary(data); err != nil {
			return
		}
		b, err := v.MarshalBinary()
		if err != nil {
			t.Fatalf("decoded value %+v does not marshal: %v", v, err)
		}
		// Only the padding may differ.
		want := bytes.Clone(data)
		want[8], want[9] = 0, 0
		if !bytes.Equal(b, want) {
			t.Fatalf("round trip %x -> %+v -> %x", data, v, b)
		}
	})
}
