package etcdtest

import (
	"os/exec"
	"syscall"
)

// setDeathSignal makes the kernel kill the server when the test binary dies
// without running its cleanups (timeout panic, SIGKILL), so no etcd is left
// behind holding ports and CPU.
func setDeathSignal(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
