package k8sclient

import (
	"context"
	"fmt"
	"time"

	"github.com/cilium/hive/cell"
)

// How often and how patiently the connectivity job asks the API server
// whether it is ready while no other request told: an idle node's health
// shows a lost API server within about connectivityInterval +
// connectivityTimeout, and one whose last request failed asks every
// failingInterval, so that its health turns OK within about a second of
// the server's return, without waiting for its next request.
const (
	connectivityInterval = 5 * time.Second
	failingInterval      = time.Second
	connectivityTimeout  = 3 * time.Second
)

// watchConnectivity is the job that asks /readyz every interval unless a
// request got an answer within it, and every failingInterval while the
// last request failed. The outcome reaches the module's health through the
// transport, like any request's.
func (c *Client) watchConnectivity(ctx context.Context, h cell.Health) error {
	h.OK(fmt.Sprintf("Asks the API server's /readyz every %s while idle, every %s while it fails", connectivityInterval, failingInterval))
	t := time.NewTicker(failingInterval)
	defer t.Stop()
	var asked time.Time
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		failing := c.stateNow.Load() == int32(stateFailing)
		if !failing && (time.Since(time.Unix(0, c.lastAnswer.Load())) < connectivityInterval || time.Since(asked) < connectivityInterval) {
			continue
		}
		asked = time.Now()
		readyz := c.endpoint("readyz")
		if readyz == "" {
			continue
		}
		pctx, cancel := context.WithTimeout(ctx, connectivityTimeout)
		_, err := c.get(pctx, readyz)
		cancel()
		if err != nil && ctx.Err() == nil {
			c.log.Debug("Kubernetes API server not ready", "server", c.Server(), "error", err)
		}
	}
}
