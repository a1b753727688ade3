package identity

import (
	"errors"
	"fmt"
	"math/bits"
	"regexp"
)

// Cluster-mesh constants.
const (
	// DefaultClusterName is the name of a cluster that set none.
	DefaultClusterName = "default"
	// MaxConnectedClusters255 and MaxConnectedClusters511 are the two
	// supported sizes of a cluster mesh.
	MaxConnectedClusters255 uint32 = 255
	MaxConnectedClusters511 uint32 = 511
	// MaxClusterNameLength is the longest cluster name.
	MaxClusterNameLength = 32
	// ClusterLabelKey is the label that names a global identity's cluster.
	ClusterLabelKey = "io.cilium.k8s.policy.cluster"
)

var clusterNameRegexp = regexp.MustCompile(`^([a-z0-9][-a-z0-9]*)?[a-z0-9]$`)

// Errors of cluster configuration.
var (
	ErrInvalidClusterName   = errors.New("invalid cluster name")
	ErrInvalidClusterID     = errors.New("invalid cluster ID")
	ErrInvalidMaxConnected  = errors.New("invalid max-connected-clusters")
	ErrDefaultNameNonZeroID = errors.New("a non-zero cluster ID needs a cluster name other than \"default\"")
)

// ClusterInfo is this cluster's identity in a cluster mesh. The zero
// MaxConnectedClusters means 255.
type ClusterInfo struct {
	ID                   uint32
	Name                 string
	MaxConnectedClusters uint32
}

// ValidateClusterName checks the rules of a cluster name: at most 32
// characters of lower-case letters, digits and '-', starting and ending with
// a letter or digit.
func ValidateClusterName(name string) error {
	if name == "" {
		return fmt.Errorf("%w: empty", ErrInvalidClusterName)
	}
	if len(name) > MaxClusterNameLength {
		return fmt.Errorf("%w %q: longer than %d characters", ErrInvalidClusterName, name, MaxClusterNameLength)
	}
	if !clusterNameRegexp.MatchString(name) {
		return fmt.Errorf("%w %q: must consist of lower-case letters, digits and '-', and start and end with a letter or digit", ErrInvalidClusterName, name)
	}
	return nil
}

func (c ClusterInfo) maxConnected() uint32 {
	if c.MaxConnectedClusters == 0 {
		return MaxConnectedClusters255
	}
	return c.MaxConnectedClusters
}

// Validate checks the cluster ID against max-connected-clusters and the name
// rules.
func (c ClusterInfo) Validate() error {
	maxc := c.maxConnected()
	if maxc != MaxConnectedClusters255 && maxc != MaxConnectedClusters511 {
		return fmt.Errorf("%w %d: must be 255 or 511", ErrInvalidMaxConnected, maxc)
	}
	if c.ID > maxc {
		return fmt.Errorf("%w %d: must be in 0..%d", ErrInvalidClusterID, c.ID, maxc)
	}
	if err := ValidateClusterName(c.Name); err != nil {
		return err
	}
	if c.ID != 0 && c.Name == DefaultClusterName {
		return fmt.Errorf("%w (cluster ID %d)", ErrDefaultNameNonZeroID, c.ID)
	}
	return nil
}

// ClusterIDShift returns how far a cluster ID is shifted into a global
// identity: 16 for 255 connected clusters, 15 for 511.
func ClusterIDShift(maxConnected uint32) uint32 {
	if maxConnected == 0 {
		maxConnected = MaxConnectedClusters255
	}
	return 24 - uint32(bits.Len32(maxConnected))
}

// MinID returns the first global identity this cluster allocates.
func (c ClusterInfo) MinID() NumericIdentity {
	if c.ID == 0 {
		return MinAllocatorIdentity
	}
	return NumericIdentity(c.ID << ClusterIDShift(c.maxConnected()))
}

// MaxID returns the last global identity this cluster allocates.
func (c ClusterInfo) MaxID() NumericIdentity {
	return NumericIdentity((c.ID+1)<<ClusterIDShift(c.maxConnected()) - 1)
}

// ClusterID returns the cluster ID encoded in a global identity.
func ClusterID(id NumericIdentity, maxConnected uint32) uint32 {
	if id.Scope() != ScopeGlobal {
		return 0
	}
	return uint32(id) >> ClusterIDShift(maxConnected)
}
