//go:build !linux

package ipcachemap

import "testing"

func openTestBPF(t testing.TB, _ Config) (Map, OpenInfo) {
	t.Skip("bpf backend needs linux")
	return nil, OpenInfo{}
}

func disableBatch(Map) {}

func memlock(Map) (uint64, bool) { return 0, false }
