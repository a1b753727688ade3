package testproc

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"time"
)

// SetDeathSignal makes the kernel kill the server when the test binary dies
// without running its cleanups (timeout panic, SIGKILL), so no server is left
// behind holding ports and CPU.
func SetDeathSignal(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

// WaitStopped waits until the kernel reports the process stopped: SIGSTOP
// takes effect asynchronously, and a test that pauses a member must not
// have it serve one more request after Pause returns.
func WaitStopped(pid int) {
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return
		}
		// The state follows the parenthesized command name.
		if i := bytes.LastIndexByte(stat, ')'); i >= 0 && i+2 < len(stat) && stat[i+2] == 'T' {
			return
		}
		time.Sleep(time.Millisecond)
	}
}
