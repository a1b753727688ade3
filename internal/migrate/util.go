package migrate

import (
	"maps"
	"slices"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

func sortedIDs(m map[identity.NumericIdentity]labels.Labels) []identity.NumericIdentity {
	return slices.Sorted(maps.Keys(m))
}
