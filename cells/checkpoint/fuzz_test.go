package checkpoint

import (
	"bytes"
	"testing"
)

// FuzzDecode checks that Decode never panics, and that whatever it accepts
// is valid and survives an encode/decode round trip unchanged.
func FuzzDecode(f *testing.F) {
	f.Add([]byte(formatsExample))
	f.Add([]byte("[]\n"))
	f.Add([]byte("null"))
	f.Add([]byte(`[{"labels":{"world":"reserved:world","10.0.0.0/8":"cidr:10.0.0.0/8"},"id":16777217,"x":[1,{"y":null}]}]`))
	f.Add([]byte(`[{"id":33554433,"labels":{"remote-node":{"key":"remote-node","source":"reserved"},"a\u00e9\ud834\udd1e":{"key":"a\u00e9\ud834\udd1e","source":"fqdn","value":"\"\\"}}}]`))
	f.Add([]byte(`[{"id":"1","labels":[]},42,{"id":1.5e3}]`))
	f.Add([]byte(`[{"id":16777217,"labels":{"10.0.0.0/8":{"key":"10.0.`))
	f.Add(AppendJSON(nil, cidrIdentities(3)))
	f.Fuzz(func(t *testing.T, data []byte) {
		ids, invalid, err := Decode(data)
		if err != nil {
			if ids != nil || invalid != nil {
				t.Fatal("results with an error")
			}
			return
		}
		for _, id := range ids {
			if err := id.Labels.Validate(); err != nil {
				t.Fatalf("accepted invalid labels %s: %v", id.Labels, err)
			}
			if err := validate(id.ID, id.Labels); err != nil {
				t.Fatalf("accepted invalid identity %d: %v", id.ID, err)
			}
		}
		enc := AppendJSON(nil, pointers(ids))
		again, invalid2, err := Decode(enc)
		if err != nil || len(invalid2) != 0 || len(again) != len(ids) {
			t.Fatalf("re-decode: %v %v, %d of %d", err, invalid2, len(again), len(ids))
		}
		if !bytes.Equal(AppendJSON(nil, pointers(again)), enc) {
			t.Fatal("round trip not stable")
		}
	})
}
