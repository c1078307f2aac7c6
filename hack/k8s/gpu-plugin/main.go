// Command gpu-plugin is the local nodes' stand-in for NVIDIA's device plugin: it advertises
// --count fake nvidia.com/gpu devices to its kubelet through the kubelet's own device plugin
// API, so the kubelet counts, allocates and frees them as it does real GPUs, and it answers an
// allocation as NVIDIA's plugin does, with NVIDIA_VISIBLE_DEVICES naming the devices given.
// There is no GPU behind them: the runtime finds no CUDA and serves from the CPU.
package main

import (
	"context"
	"crypto/sha256"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

const (
	resourceName = "nvidia.com/gpu"
	socketName   = "ladle-gpu.sock"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices []*pluginapi.Device
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

// ListAndWatch sends the devices once: fake devices never turn unhealthy.
func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, container := range req.ContainerRequests {
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(container.DevicesIds, ",")},
		})
	}
	return resp, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

// deviceID is a stable, UUID-shaped id per node and index, as NVIDIA's GPU UUIDs look.
func deviceID(node string, index int) string {
	sum := sha256.Sum256([]byte(fmt.Sprintf("%s/%d", node, index)))
	h := fmt.Sprintf("%x", sum[:16])
	return fmt.Sprintf("GPU-%s-%s-%s-%s-%s", h[:8], h[8:12], h[12:16], h[16:20], h[20:32])
}

// serve listens on the plugin's socket and registers with the kubelet; it returns the server
// once the kubelet has accepted the registration.
func serve(dir string, p *plugin) (*grpc.Server, error) {
	socket := filepath.Join(dir, socketName)
	if err := os.Remove(socket); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	listener, err := net.Listen("unix", socket)
	if err != nil {
		return nil, err
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, p)
	go func() { _ = server.Serve(listener) }()
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "kubelet.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		server.Stop()
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     socketName,
		ResourceName: resourceName,
	})
	if err != nil {
		server.Stop()
		return nil, err
	}
	return server, nil
}

// inode of a path, 0 if it is missing: a restarted kubelet makes a new registration socket
// and removes every other socket in the folder, ours too, which means: register again.
func inode(path string) uint64 {
	info, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return info.Sys().(*syscall.Stat_t).Ino
}

func main() {
	dir := flag.String("device-plugin-dir", pluginapi.DevicePluginPath, "the kubelet's device plugin folder")
	count := flag.Int("count", 4, "fake GPUs to advertise")
	node := flag.String("node", "", "the node's name (devices get stable ids from it)")
	flag.Parse()
	p := &plugin{}
	for i := 0; i < *count; i++ {
		p.devices = append(p.devices, &pluginapi.Device{ID: deviceID(*node, i), Health: pluginapi.Healthy})
	}
	kubelet := filepath.Join(*dir, "kubelet.sock")
	var server *grpc.Server
	var registeredWith uint64
	for {
		current := inode(kubelet)
		if server != nil && (current != registeredWith || inode(filepath.Join(*dir, socketName)) == 0) {
			log.Printf("the kubelet restarted: registering again")
			server.Stop()
			server = nil
		}
		if server == nil && current != 0 {
			s, err := serve(*dir, p)
			if err != nil {
				log.Printf("registering with the kubelet: %v", err)
			} else {
				server, registeredWith = s, current
				log.Printf("registered %d %s devices with the kubelet", *count, resourceName)
			}
		}
		time.Sleep(time.Second)
	}
}
