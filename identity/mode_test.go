package identity

import "testing"

func TestAllocationModeValidate(t *testing.T) {
	for _, m := range []AllocationMode{AllocationModeKVStore, AllocationModeCRD} {
		if err := m.Validate(); err != nil {
			t.Errorf("%q: %v", m, err)
		}
	}
	for _, m := range []AllocationMode{"", "etcd", "CRD", "kvstore "} {
		err := m.Validate()
		want := `invalid --identity-allocation-mode "` + string(m) + `": must be one of "kvstore", "crd", "doublewrite-readkvstore", "doublewrite-readcrd"`
		if err == nil || err.Error() != want {
			t.Errorf("%q: %v, want %s", m, err, want)
		}
	}
}

func TestAllocationModeStores(t *testing.T) {
	for _, c := range []struct {
		m                 AllocationMode
		read, write       AllocationMode
		kv, crd, dw, vali bool
	}{
		{AllocationModeKVStore, AllocationModeKVStore, "", true, false, false, true},
		{"", "", "", true, false, false, false},
		{AllocationModeCRD, AllocationModeCRD, "", false, true, false, true},
		{AllocationModeDoubleWriteReadKVStore, AllocationModeKVStore, AllocationModeCRD, true, true, true, true},
		{AllocationModeDoubleWriteReadCRD, AllocationModeCRD, AllocationModeKVStore, true, true, true, true},
	} {
		if c.m.ReadStore() != c.read || c.m.WriteOnlyStore() != c.write || c.m.UsesKVStore() != c.kv ||
			c.m.UsesCRD() != c.crd || c.m.DoubleWrite() != c.dw || (c.m.Validate() == nil) != c.vali {
			t.Errorf("%q: read %q write %q kvstore %v crd %v doublewrite %v valid %v", c.m, c.m.ReadStore(), c.m.WriteOnlyStore(),
				c.m.UsesKVStore(), c.m.UsesCRD(), c.m.DoubleWrite(), c.m.Validate() == nil)
		}
	}
}
