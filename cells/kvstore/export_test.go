package kvstore

// HoldHealthReports makes the client's health reports wait until release
// is called, so a test can look at the moment between a change of the
// lease and its report.
func HoldHealthReports(c *Client) (release func()) {
	c.healthMu.Lock()
	return c.healthMu.Unlock
}
