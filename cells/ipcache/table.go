package ipcache

import (
	"encoding/json"
	"fmt"
	"iter"
	"net/netip"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/labels"
)

// TableName is the name of the ipcache table.
const TableName = "ipcache"

// Source tells which kind of contribution decided a prefix's identity.
type Source uint8

// Sources of a prefix's identity.
const (
	// SourceMetadata: the identity was allocated for the merged labels of
	// the owners' metadata.
	SourceMetadata Source = iota
	// SourceDirect: an owner gave the identity itself (no allocation).
	SourceDirect
)

func (s Source) String() string {
	if s == SourceDirect {
		return "direct"
	}
	return "metadata"
}

// MarshalJSON writes the source's name.
func (s Source) MarshalJSON() ([]byte, error) { return json.Marshal(s.String()) }

// ResourceID names the owner of a contribution, e.g. "restored",
// "k8s/cidrgroup/default/foo" or "shell". It is free text, but not empty
// and without control characters (it is printed in tables and logs); an
// owner uses the same ID to update and to remove what it contributed.
type ResourceID string

// Validate checks that the ID can name an owner.
func (r ResourceID) Validate() error {
	if r == "" {
		return fmt.Errorf("%w: empty owner", ErrInvalidOwner)
	}
	if !utf8.ValidString(string(r)) {
		return fmt.Errorf("%w %q: not UTF-8", ErrInvalidOwner, string(r))
	}
	for _, c := range string(r) {
		if unicode.IsControl(c) {
			return fmt.Errorf("%w %q: control character", ErrInvalidOwner, string(r))
		}
	}
	return nil
}

// Info is what one owner says about one prefix. It is either metadata
// (Labels and/or RequestedID, resolved to an identity through the
// allocator) or a direct identity (Identity non-zero, used as is), never
// both. The zero Info is metadata without labels: the prefix gets its plain
// CIDR identity.
type Info struct {
	// Labels are merged with the prefix's CIDR labels and the other
	// owners' labels.
	Labels labels.Labels `json:"labels,omitempty"`
	// RequestedID asks the allocator for this numeric identity (as
	// restoration does when it knows a prefix's old identity but not its
	// labels). It is only used when no owner of the prefix gives labels.
	RequestedID identity.NumericIdentity `json:"requested-id,omitempty"`
	// Identity, when non-zero, is the prefix's identity as is, as for
	// endpoints whose identity is already known.
	Identity identity.NumericIdentity `json:"identity,omitempty"`
	// TunnelEndpoint and EncryptKey go to the map with a direct identity.
	TunnelEndpoint netip.Addr `json:"tunnel-endpoint,omitzero"`
	EncryptKey     uint8      `json:"encrypt-key,omitempty"`
}

// IsDirect tells whether the Info carries a direct identity.
func (i Info) IsDirect() bool { return i.Identity != 0 }

// Validate checks that the Info is either metadata or a direct identity
// and that its tunnel endpoint fits the map.
func (i Info) Validate() error {
	if i.IsDirect() {
		// The map holds any uint32; only a real identity may get there.
		if err := i.Identity.Validate(); err != nil {
			return fmt.Errorf("%w: identity: %w", ErrInvalidInfo, err)
		}
		if len(i.Labels) > 0 || i.RequestedID != 0 {
			return fmt.Errorf("%w: a direct identity excludes labels and a requested ID", ErrInvalidInfo)
		}
		if i.TunnelEndpoint.IsValid() && !i.TunnelEndpoint.Is4() {
			return fmt.Errorf("%w: tunnel endpoint %s is not IPv4", ErrInvalidInfo, i.TunnelEndpoint)
		}
		return nil
	}
	if i.TunnelEndpoint.IsValid() || i.EncryptKey != 0 {
		return fmt.Errorf("%w: tunnel endpoint and encryption key need a direct identity", ErrInvalidInfo)
	}
	if i.RequestedID != 0 {
		if err := i.RequestedID.Validate(); err != nil {
			return fmt.Errorf("%w: requested ID: %w", ErrInvalidInfo, err)
		}
	}
	if err := i.Labels.Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidInfo, err)
	}
	return nil
}

// Contribution is one owner's Info for a prefix.
type Contribution struct {
	Owner ResourceID `json:"owner"`
	Info
	// seq orders direct identities: the latest upsert wins.
	seq uint64
}

// Entry is one row of the ipcache table: a prefix, the identity the
// datapath map gets for it, every owner's contribution and the
// reconciliation status. Entries are immutable once in the table; a change
// inserts a new *Entry.
type Entry struct {
	// Prefix is masked; IPv4 prefixes are never IPv4-mapped IPv6.
	Prefix netip.Prefix `json:"prefix"`
	// Identity is the numeric identity written to the map.
	Identity identity.NumericIdentity `json:"identity"`
	// Source says whether Identity was allocated for the metadata or given
	// directly.
	Source Source `json:"source"`
	// Labels are the identity's labels when it was allocated (the merged
	// metadata); empty for a direct identity.
	Labels labels.Labels `json:"labels,omitempty"`
	// TunnelEndpoint and EncryptKey come from the winning direct identity.
	TunnelEndpoint netip.Addr `json:"tunnel-endpoint,omitzero"`
	EncryptKey     uint8      `json:"encrypt-key,omitempty"`
	// Owners holds every owner's contribution, sorted by owner.
	Owners []Contribution `json:"owners"`
	// Status is the reconciliation status towards the datapath map.
	Status reconciler.Status `json:"status"`

	// held is the identity on which this prefix holds its one allocator
	// reference, nil for a direct identity.
	held *identity.Identity
}

// Owner returns the contribution of owner, if any.
func (e *Entry) Owner(owner ResourceID) (Contribution, bool) {
	for _, c := range e.Owners {
		if c.Owner == owner {
			return c, true
		}
	}
	return Contribution{}, false
}

// TableHeader implements statedb.TableWritable.
func (*Entry) TableHeader() []string {
	return []string{"Prefix", "Identity", "Source", "Labels", "Owners", "Status"}
}

// TableRow implements statedb.TableWritable. The status shows its kind and
// error without times, so that rows can be compared in tests.
func (e *Entry) TableRow() []string {
	owners := make([]string, len(e.Owners))
	for i, c := range e.Owners {
		owners[i] = string(c.Owner)
	}
	status := e.Status.Kind.String()
	if e.Status.Kind == reconciler.StatusKindError {
		status += ": " + e.Status.GetError()
	}
	return []string{
		e.Prefix.String(),
		e.Identity.String(),
		e.Source.String(),
		e.Labels.String(),
		strings.Join(owners, ","),
		status,
	}
}

func (e *Entry) clone() *Entry {
	c := *e
	return &c
}

func (e *Entry) getStatus() reconciler.Status { return e.Status }

func (e *Entry) setStatus(s reconciler.Status) *Entry {
	e.Status = s
	return e
}

// PrefixIndex finds the row of exactly a prefix (primary index).
var PrefixIndex = statedb.Index[*Entry, netip.Prefix]{
	Name: "prefix",
	FromObject: func(e *Entry) index.KeySet {
		return index.NewKeySet(index.NetIPPrefix(e.Prefix))
	},
	FromKey:    index.NetIPPrefix,
	FromString: index.NetIPPrefixString,
	Unique:     true,
}

// LPMIndex finds the row of the longest prefix that contains an address:
// table.Get(txn, LPMIndex.Query(addr)).
var LPMIndex = statedb.NetIPPrefixIndex[*Entry]{
	Name: "lpm",
	FromObject: func(e *Entry) iter.Seq[netip.Prefix] {
		return statedb.Just(e.Prefix)
	},
	Unique: true,
}

// OwnerIndex finds the rows an owner contributes to, so that an owner's
// contributions can be removed at once without a scan of the table.
var OwnerIndex = statedb.Index[*Entry, ResourceID]{
	Name: "owner",
	FromObject: func(e *Entry) index.KeySet {
		if len(e.Owners) == 1 {
			return index.NewKeySet(index.String(string(e.Owners[0].Owner)))
		}
		if len(e.Owners) == 0 {
			return index.EmptyKeySet
		}
		keys := make([]index.Key, len(e.Owners))
		for i, c := range e.Owners {
			keys[i] = index.String(string(c.Owner))
		}
		return index.NewKeySet(keys[0], keys[1:]...)
	},
	FromKey:    func(r ResourceID) index.Key { return index.String(string(r)) },
	FromString: index.FromString,
	Unique:     false,
}

// NewTable creates the ipcache table; the cell provides it read-only as
// statedb.Table[*Entry].
func NewTable(db *statedb.DB) (statedb.RWTable[*Entry], error) {
	return statedb.NewTable(db, TableName, PrefixIndex, LPMIndex, OwnerIndex)
}
