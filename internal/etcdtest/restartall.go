package etcdtest

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// RestartAll stops every member (gracefully, like Member.Restart) and
// starts them all again on their data directories and ports, then waits
// for a leader. The members start together because a member that was part
// of a quorum does not serve clients until a quorum is back: restarting
// them one by one would wait forever on the first.
func (c *Cluster) RestartAll() {
	c.tb.Helper()
	for _, m := range c.members {
		m.Stop()
	}
	if err := c.respawnAll(); err != nil {
		c.killAll()
		c.tb.Fatalf("etcdtest: restarting the cluster: %v", err)
	}
	c.WaitLeader(c.tb)
}

func (c *Cluster) respawnAll() error {
	var err error
	for range startAttempts {
		for _, m := range c.members {
			if err = m.spawn(); err != nil {
				return err
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), c.opts.readyTimeout)
		errs := make(chan error, len(c.members))
		for _, m := range c.members {
			go func() { errs <- m.waitReady(ctx, false) }()
		}
		err = nil
		for range c.members {
			err = errors.Join(err, <-errs)
		}
		cancel()
		if err == nil {
			return nil
		}
		if !errors.Is(err, errPortClash) {
			return err
		}
		// A port is ours again once its current holder lets go.
		c.killAll()
		time.Sleep(500 * time.Millisecond)
	}
	return fmt.Errorf("ports stayed taken: %w", err)
}
