package globalstore

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
)

// ErrNodeNameInUse: another live agent uses this node name in the store.
var ErrNodeNameInUse = errors.New("node name is in use by another live agent")

// NodeClaim names the agent process behind a node name: a store writes it
// where its node's name is recorded (etcd's node key, the IdentityNode
// object), so that a second agent started with the same --node-name can
// tell a live owner from one that is gone.
type NodeClaim struct {
	Instance string `json:"instance"`
	Host     string `json:"host"`
	PID      int    `json:"pid"`
}

// NewNodeClaim returns a claim of this process with a fresh random
// instance.
func NewNodeClaim() NodeClaim {
	var b [8]byte
	_, _ = rand.Read(b[:])
	host, _ := os.Hostname()
	return NodeClaim{Instance: hex.EncodeToString(b[:]), Host: host, PID: os.Getpid()}
}

func (c NodeClaim) String() string {
	return fmt.Sprintf("host %q, pid %d, instance %s", c.Host, c.PID, c.Instance)
}

// liveInstances holds the instances of the stores of this process that
// hold their node name: a claim with this process's host and PID that is
// not among them was left by a hive of this process that is gone, while
// one that is among them belongs to another hive that runs beside.
var liveInstances sync.Map

// Hold marks c as the claim of a running store of this process.
func (c NodeClaim) Hold() { liveInstances.Store(c.Instance, struct{}{}) }

// Forget ends Hold, when the store stops.
func (c NodeClaim) Forget() { liveInstances.Delete(c.Instance) }

// Gone reports whether the agent that made other is certainly gone, as
// the agent of c sees it: other ran on this host and its process has ended,
// or it was a store of this process that no longer runs. An agent of
// another host is never known to be gone.
func (c NodeClaim) Gone(other NodeClaim) bool {
	if other.Host != c.Host {
		return false
	}
	if other.PID == c.PID {
		_, live := liveInstances.Load(other.Instance)
		return !live
	}
	return !ProcessAlive(other.PID)
}

// ProcessAlive reports whether pid names a running process of this host. A
// zombie (killed, not yet reaped by its parent) is not running: its agent
// holds nothing any more.
func ProcessAlive(pid int) bool {
	if pid <= 0 || errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return !errors.Is(err, os.ErrNotExist)
	}
	// The state follows the command name, which is in parentheses and
	// may hold anything, so look after the last ")".
	if i := bytes.LastIndexByte(stat, ')'); i >= 0 && i+2 < len(stat) {
		return stat[i+2] != 'Z' && stat[i+2] != 'X'
	}
	return true
}
