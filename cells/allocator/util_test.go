package allocator

import (
	"context"
	"sync"
	"sync/atomic"
)

type atomicCounter struct{ n atomic.Int64 }

// add returns the counter's value before incrementing it.
func (c *atomicCounter) add() int64 { return c.n.Add(1) - 1 }

// standalone holds the loops of allocators run outside a hive.
var standalone sync.Map // *identityAllocator -> func()

// startStandalone runs a's loops as the cell's jobs would, then Start.
func (a *identityAllocator) startStandalone(ctx context.Context) error {
	loopCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	jobs := []func(context.Context){a.table.Run, a.disp.run}
	for _, run := range jobs {
		wg.Go(func() { run(loopCtx) })
	}
	standalone.Store(a, func() { cancel(); wg.Wait() })
	if err := a.Start(ctx); err != nil {
		a.stopStandalone(ctx)
		return err
	}
	return nil
}

// stopStandalone is Stop, then the end of the loops: the dispatcher
// drains, then the table writer flushes, as the jobs stop in a hive.
func (a *identityAllocator) stopStandalone(ctx context.Context) error {
	err := a.Stop(ctx)
	if stop, ok := standalone.LoadAndDelete(a); ok {
		stop.(func())()
	}
	return err
}
