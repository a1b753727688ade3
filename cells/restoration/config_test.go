package restoration_test

import (
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive/cell"

	"github.com/identityd/identityd/cells/restoration"
)

// TestAutomaticGracePeriod checks what --identity-restore-grace-period=0
// stands for: the hive's AutomaticGracePeriod when it provides one,
// EmbeddedGracePeriod when it provides none (a hive without the kvstore
// gets a sane default), and the flag when it is set.
func TestAutomaticGracePeriod(t *testing.T) {
	provide := func(d time.Duration) cell.Cell {
		return cell.Provide(func() restoration.AutomaticGracePeriod { return restoration.AutomaticGracePeriod{Period: d} })
	}
	for _, tc := range []struct {
		name  string
		flag  time.Duration
		extra []cell.Cell
		want  time.Duration
	}{
		{"none provided", 0, nil, restoration.EmbeddedGracePeriod},
		{"zero provided", 0, []cell.Cell{provide(0)}, restoration.EmbeddedGracePeriod},
		{"external kvstore", 0, []cell.Cell{cell.Provide(func() restoration.AutomaticGracePeriod { return restoration.AutomaticGracePeriodFor(true) })}, restoration.ExternalGracePeriod},
		{"embedded kvstore", 0, []cell.Cell{cell.Provide(func() restoration.AutomaticGracePeriod { return restoration.AutomaticGracePeriodFor(false) })}, restoration.EmbeddedGracePeriod},
		{"provided", 0, []cell.Cell{provide(7 * time.Minute)}, 7 * time.Minute},
		{"flag wins", time.Hour, []cell.Cell{provide(7 * time.Minute)}, time.Hour},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := newAgent(t, t.TempDir(), tc.flag, nil, tc.extra...)
			if err := a.h.Populate(a.log); err != nil {
				t.Fatal(err)
			}
			if got := a.r.GracePeriod(); got != tc.want {
				t.Errorf("grace period %s, want %s", got, tc.want)
			}
		})
	}

	// A negative automatic period is a bug of the hive that provides it.
	a := newAgent(t, t.TempDir(), 0, nil, provide(-time.Second))
	if err := a.h.Populate(a.log); err == nil || !strings.Contains(err.Error(), "must not be negative") {
		t.Fatalf("negative automatic grace period: %v", err)
	}
}
