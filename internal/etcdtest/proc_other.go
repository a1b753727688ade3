//go:build !linux

package etcdtest

import "os/exec"

func setDeathSignal(*exec.Cmd) {}

func waitStopped(int) {}
