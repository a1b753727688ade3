package ipcache

// SetMapWriteFault makes every write of the map file (the file backend)
// call fault before each of its steps (atomicfile.WriteSteps), so that a
// test can stall or fail the disk; call it before the hive starts.
func SetMapWriteFault(c *IPCache, fault func(step string) error) {
	c.mapConfig.WriteFault = fault
}
