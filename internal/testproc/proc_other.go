//go:build !linux

package testproc

import "os/exec"

func SetDeathSignal(*exec.Cmd) {}

func WaitStopped(int) {}
