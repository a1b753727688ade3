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
		want := `invalid --identity-allocation-mode "` + string(m) + `": must be one of "kvstore", "crd"`
		if err == nil || err.Error() != want {
			t.Errorf("%q: %v, want %s", m, err, want)
		}
	}
}
