package allocator_test

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/labels"
)

// startAllocator runs a hive of the allocator alone: local identities only,
// as without a kvstore.
func startAllocator() (allocator.Allocator, func()) {
	var a allocator.Allocator
	h := hive.New(job.Cell, statedb.Cell, allocator.Cell,
		cell.Invoke(func(x allocator.Allocator) { a = x }))
	log := slog.New(slog.DiscardHandler)
	if err := h.Start(log, context.Background()); err != nil {
		panic(err)
	}
	return a, func() { h.Stop(log, context.Background()) }
}

// Allocating the same label set twice gives the same identity: the first
// call creates it, the second takes another reference. A CIDR label set is
// node-local, numbered from 0x01000001.
func ExampleAllocator_Allocate() {
	a, stop := startAllocator()
	defer stop()
	ctx := context.Background()

	lbls := labels.MustParse("cidr:10.0.0.0/8", "reserved:world")
	first, allocated, err := a.Allocate(ctx, lbls)
	if err != nil {
		panic(err)
	}
	fmt.Printf("%d %#x allocated=%v\n", first.ID, uint32(first.ID), allocated)

	again, allocated, _ := a.Allocate(ctx, lbls)
	fmt.Println(again.ID == first.ID, "allocated:", allocated)

	// One release per reference; the last one frees the identity.
	released, _ := a.Release(ctx, again)
	fmt.Println("released:", released)
	released, _ = a.Release(ctx, first)
	fmt.Println("released:", released)
	// Output:
	// 16777217 0x1000001 allocated=true
	// true allocated: false
	// released: false
	// released: true
}

// Observe first replays every identity the allocator knows, then sends one
// ChangeSync, then every change as it happens.
func ExampleAllocator_Observe() {
	a, stop := startAllocator()
	defer stop()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	changes := make(chan allocator.Change, 1024)
	a.Observe(ctx, func(c allocator.Change) { changes <- c }, func(error) { close(changes) })

	// The replay: the reserved identities, then the sync marker.
	reserved := 0
	for c := range changes {
		if c.Kind == allocator.ChangeSync {
			break
		}
		reserved++
	}
	fmt.Println("replayed reserved identities:", reserved > 0)

	id, _, err := a.Allocate(ctx, labels.MustParse("cidr:192.0.2.0/24", "reserved:world"))
	if err != nil {
		panic(err)
	}
	c := <-changes
	fmt.Println(c.Kind, c.ID == id.ID, c.Labels)

	a.Release(ctx, id)
	c = <-changes
	fmt.Println(c.Kind, c.ID == id.ID)
	// Output:
	// replayed reserved identities: true
	// upsert true cidr:192.0.2.0/24,reserved:world
	// delete true
}
