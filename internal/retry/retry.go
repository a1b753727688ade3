// Package retry holds the pacing that the stores' retry loops share.
package retry

import (
	"context"
	"math/rand/v2"
	"time"
)

// Backoff returns a jittered delay growing with the attempt number n, from
// a few milliseconds to a second. The jitter keeps nodes that failed at the
// same moment from retrying in step.
func Backoff(n int) time.Duration {
	d := 5 * time.Millisecond << min(n, 8)
	d = min(d, time.Second)
	return d/2 + rand.N(d/2+1)
}

// Sleep waits for d or until ctx ends, whichever comes first.
func Sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}
