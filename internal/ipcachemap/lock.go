package ipcachemap

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrInUse is wrapped by Open when another live agent holds the map: two
// agents on one datapath map would each prune the other's entries.
var ErrInUse = errors.New("ipcache map is in use by another agent")

// Names of the lock beside a map: <pin path>-lock for the bpf backend (a
// directory, since bpffs holds no regular files and no names with a '.'),
// <file>.lock for the file backend.
const (
	PinLockSuffix  = "-lock"
	FileLockSuffix = ".lock"
)

// mapLock is an exclusive flock held for as long as a map is open. The
// kernel drops it when the holder exits, however it exits, so a crashed
// agent never leaves a stale lock behind.
type mapLock struct{ f *os.File }

// lockMap takes the lock of the map at path, lockPath: a directory when dir
// is set, else a regular file. The lock object is never removed, so that
// every agent locks the same inode.
func lockMap(path, lockPath string, dir bool) (*mapLock, error) {
	var (
		f   *os.File
		err error
	)
	if dir {
		if err := os.Mkdir(lockPath, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
			return nil, fmt.Errorf("cannot create lock %s of ipcache map %s: %w", lockPath, path, err)
		}
		f, err = os.OpenFile(lockPath, os.O_RDONLY|unix.O_DIRECTORY, 0)
	} else {
		f, err = os.OpenFile(lockPath, os.O_RDWR|os.O_CREATE, 0o600)
	}
	if err != nil {
		return nil, fmt.Errorf("cannot open lock %s of ipcache map %s: %w", lockPath, path, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		holder := lockHolder(f)
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: %s is locked (%s) by %s; give each agent its own map (--ipcache-map-pin-path, --state-dir)",
				ErrInUse, path, lockPath, holder)
		}
		return nil, fmt.Errorf("cannot lock %s of ipcache map %s: %w", lockPath, path, err)
	}
	return &mapLock{f: f}, nil
}

func (l *mapLock) release() error {
	if l == nil || l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}

// lockHolder names the process that holds an flock on f's inode, from
// /proc/locks, or says that it is unknown (another pid namespace, no
// procfs).
func lockHolder(f *os.File) string {
	const unknown = "an unknown process"
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return unknown
	}
	// /proc/locks names the inode as major:minor:inode, the device
	// numbers in hex.
	id := fmt.Sprintf("%02x:%02x:%d", unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino)
	locks, err := os.Open("/proc/locks")
	if err != nil {
		return unknown
	}
	defer locks.Close()
	sc := bufio.NewScanner(locks)
	for sc.Scan() {
		// "1: FLOCK  ADVISORY  WRITE 1234 00:2c:567 0 EOF"; waiters
		// have "->" after the number and hold nothing.
		fields := strings.Fields(sc.Text())
		if len(fields) < 6 || fields[1] == "->" || fields[1] != "FLOCK" || fields[5] != id {
			continue
		}
		pid, err := strconv.Atoi(fields[4])
		if err != nil {
			continue
		}
		return describePID(pid)
	}
	return unknown
}

func describePID(pid int) string {
	s := "pid " + strconv.Itoa(pid)
	if comm, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm"); err == nil {
		s += " (" + strings.TrimSpace(string(comm)) + ")"
	}
	if pid == os.Getpid() {
		s += ", this process"
	}
	return s
}
