//go:build linux

package ipcachemap

import (
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// onRestrictedThread runs fn on an OS thread of its own that restrict has
// changed (a seccomp filter, capabilities: both are per thread), which
// ends with fn: no other goroutine ever runs on it.
func onRestrictedThread(t *testing.T, restrict func() error, fn func()) {
	t.Helper()
	done := make(chan error)
	go func() {
		// Never unlocked: the thread exits with the goroutine.
		runtime.LockOSThread()
		if err := restrict(); err != nil {
			done <- err
			return
		}
		fn()
		done <- nil
	}()
	if err := <-done; err != nil {
		t.Skipf("cannot restrict a thread here: %v", err)
	}
}

// refuseBPF installs, on the calling thread, the seccomp filter of a
// container runtime's default profile that allows bpf(2) only with
// CAP_SYS_ADMIN, for a caller without it: bpf(2) fails with EPERM.
func refuseBPF() error {
	filter := []unix.SockFilter{
		{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: 0}, // seccomp_data.nr
		{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: 0, Jf: 1, K: unix.SYS_BPF},
		{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)},
		{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ALLOW},
	}
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	if _, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, 0, uintptr(unsafe.Pointer(&prog))); errno != 0 {
		return errno
	}
	return nil
}

// dropBPFCaps takes CAP_BPF and CAP_SYS_ADMIN from the calling thread's
// effective set, as a container that does not add them runs.
func dropBPFCaps() error {
	const capSysAdmin, capBPF = unix.CAP_SYS_ADMIN, unix.CAP_BPF
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return err
	}
	data[capSysAdmin/32].Effective &^= 1 << (capSysAdmin % 32)
	data[capBPF/32].Effective &^= 1 << (capBPF % 32)
	return unix.Capset(&hdr, &data[0])
}

// TestBPFRefusedErrorNamesCause: when the kernel refuses bpf(2) itself
// (EPERM), opening the map fails with an error that names the cause on
// this thread, a seccomp filter or the missing capability, and not the
// pinned object, whether a map is pinned already (open) or not (create;
// without a capability only the creation is refused).
func TestBPFRefusedErrorNamesCause(t *testing.T) {
	requireBPF(t)
	for _, tc := range []struct {
		name     string
		restrict func() error
		want     string
	}{
		{"seccomp", refuseBPF, "a seccomp filter is in force"},
		{"no-capability", dropBPFCaps, "neither CAP_BPF nor CAP_SYS_ADMIN"},
	} {
		for _, pinned := range []bool{true, false} {
			if tc.name == "no-capability" && pinned {
				// Since Linux 6.5 opening a pinned map needs no
				// capability, only the pin's file permissions.
				continue
			}
			name := tc.name + map[bool]string{true: "/open", false: "/create"}[pinned]
			t.Run(name, func(t *testing.T) {
				pin := testPinPath(t)
				if pinned {
					m, _ := openTestBPF(t, Config{PinPath: pin, MaxEntries: 10})
					m.Close()
				}
				var err error
				onRestrictedThread(t, tc.restrict, func() {
					var m Map
					if m, _, err = Open(Config{Kind: KindBPF, PinPath: pin, MaxEntries: 10}); err == nil {
						m.Close()
					}
				})
				switch {
				case err == nil:
					t.Fatal("Open succeeded with bpf(2) refused")
				case !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "bpf(2) refused"):
					t.Errorf("Open with bpf(2) refused: %v\nwant the cause named: %q", err, tc.want)
				case strings.Contains(err.Error(), "something other than a map"):
					t.Errorf("Open with bpf(2) refused blames the pinned object: %v", err)
				}
				// The refusal left the pin and its lock as they were: an
				// unrestricted open works.
				m, _ := openTestBPF(t, Config{PinPath: pin, MaxEntries: 10})
				m.Close()
			})
		}
	}
}

// TestBPFPinInBindMountedDirectory opens the map in a directory of the
// bpffs bind-mounted elsewhere, as a pod that mounts only identityd's own
// directory of the host's bpffs sees it: no bpffs is mounted (the bind
// mount is one), and the map is pinned in the host's directory.
func TestBPFPinInBindMountedDirectory(t *testing.T) {
	requireBPF(t)
	hostDir := filepath.Dir(testPinPath(t))
	if err := os.MkdirAll(hostDir, 0o700); err != nil {
		t.Fatal(err)
	}
	podDir := t.TempDir()
	var info OpenInfo
	var err error
	onRestrictedThread(t, func() error {
		// A mount namespace of this thread's own, as the pod's.
		if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
			return err
		}
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
			return err
		}
		return unix.Mount(hostDir, podDir, "", unix.MS_BIND, "")
	}, func() {
		var m Map
		if m, info, err = Open(Config{Kind: KindBPF, PinPath: filepath.Join(podDir, "ipcache"), MaxEntries: 10}); err == nil {
			err = m.Close()
		}
	})
	if err != nil {
		t.Fatalf("Open in a bind-mounted directory of the bpffs: %v", err)
	}
	if info.MountedBPFFS != "" || !info.Created {
		t.Errorf("Open: %+v, want the map created without a bpffs mounted", info)
	}
	// The pod's pin is the host's.
	m, err := ebpf.LoadPinnedMap(filepath.Join(hostDir, "ipcache"), nil)
	if err != nil {
		t.Fatalf("the map is not pinned in the host's directory: %v", err)
	}
	m.Close()
}
