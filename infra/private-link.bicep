// One service reached privately: a private endpoint in the given subnet, the private DNS zone that
// resolves the service's name to it inside the virtual network, the zone's link to that network, and
// the zone group that keeps the zone's record in step with the endpoint's address.

param name string
param location string
param tags object
param virtualNetworkId string
param subnetId string
@description('Resource id of the service (storage account, Azure OpenAI account, key vault).')
param targetId string
@description('Private link sub-resource: blob, queue, table, account (Azure OpenAI) or vault.')
param groupId string
@description('Private DNS zone of that sub-resource, e.g. privatelink.blob.core.windows.net.')
param zoneName string

resource zone 'Microsoft.Network/privateDnsZones@2024-06-01' = {
  name: zoneName
  location: 'global'
  tags: tags
}

resource zoneLink 'Microsoft.Network/privateDnsZones/virtualNetworkLinks@2024-06-01' = {
  parent: zone
  name: '${name}-link'
  location: 'global'
  tags: tags
  properties: {
    registrationEnabled: false
    virtualNetwork: {
      id: virtualNetworkId
    }
  }
}

resource endpoint 'Microsoft.Network/privateEndpoints@2024-05-01' = {
  name: name
  location: location
  tags: tags
  properties: {
    subnet: {
      id: subnetId
    }
    privateLinkServiceConnections: [
      {
        name: name
        properties: {
          privateLinkServiceId: targetId
          groupIds: [
            groupId
          ]
        }
      }
    ]
  }
}

resource zoneGroup 'Microsoft.Network/privateEndpoints/privateDnsZoneGroups@2024-05-01' = {
  parent: endpoint
  name: 'default'
  properties: {
    privateDnsZoneConfigs: [
      {
        name: groupId
        properties: {
          privateDnsZoneId: zone.id
        }
      }
    ]
  }
  dependsOn: [
    zoneLink
  ]
}
