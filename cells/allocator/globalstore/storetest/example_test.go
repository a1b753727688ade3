package storetest_test

import (
	"fmt"

	"github.com/identityd/identityd/cells/allocator/globalstore"
	"github.com/identityd/identityd/cells/allocator/globalstore/storetest"
	"github.com/identityd/identityd/labels"
)

// Events records what a store reports to the allocator; Refs is this
// node's record of references, which the store reads.
func ExampleEvents() {
	ev := storetest.NewEvents()
	web := labels.MustParse("k8s:app=web")
	ev.Upsert(1000, web)
	ev.Synced()
	<-ev.Listed()
	l, ok := ev.Get(1000)
	fmt.Println(l, ok)
	ev.Delete(1000, web)
	_, ok = ev.Get(1000)
	fmt.Println(ok, ev.Deletes(1000))

	refs := storetest.NewRefs()
	refs.Record(globalstore.NewReference(1000, web, 0))
	fmt.Println(refs.Len(), refs.ByID(1000).Labels)
	refs.Remove(1000)
	fmt.Println(refs.Len())
	// Output:
	// k8s:app=web true
	// false 1
	// 1 k8s:app=web
	// 0
}
