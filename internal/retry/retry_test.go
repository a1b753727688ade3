package retry

import (
	"context"
	"testing"
	"time"
)

func TestBackoffBounds(t *testing.T) {
	for n := range 20 {
		d := 5 * time.Millisecond << min(n, 8)
		d = min(d, time.Second)
		for range 100 {
			if got := Backoff(n); got < d/2 || got > d {
				t.Fatalf("Backoff(%d) = %v, want within [%v, %v]", n, got, d/2, d)
			}
		}
	}
}

func TestSleepEndsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	start := time.Now()
	Sleep(ctx, time.Hour)
	if el := time.Since(start); el > 10*time.Second {
		t.Fatalf("Sleep with an ended context took %v", el)
	}
}
